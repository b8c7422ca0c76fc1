"""Reasoning parsers without a model: whole replies, replies streamed in any pieces, and with tool calls."""

from __future__ import annotations

import random

import pytest

from asyncllm.errors import ConfigError
from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_responses import Choices
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.reasoning import get_reasoning_parser
from asyncllm.sampling import SamplingParams
from asyncllm.structured.spec import StructuredOutputs
from asyncllm.structured.start_after import Marker, with_start_after_ids
from asyncllm.tool_calls import get_tool_parser

CASES = {  # reply: (deepseek_r1's, qwen3's and seed_oss's split; glm45's, whose reply opens the thinking itself;
    # mistral's, as glm45's but a [/THINK] without [THINK] is dropped). The text is kept as written (vLLM's NEW_LINE).
    "<think>\nLet me see.\n</think>\n\nIt is 4.": (("\nLet me see.\n", "\n\nIt is 4."),) * 3,
    "Opened by the prompt.</think>\n\nFour.": (("Opened by the prompt.", "\n\nFour."),
                                               (None, "Opened by the prompt.</think>\n\nFour."),
                                               (None, "Opened by the prompt.\n\nFour.")),
    "<think>cut short while thinking": (("cut short while thinking", None),) * 3,
    "No thinking at all": (("No thinking at all", None), (None, "No thinking at all"), (None, "No thinking at all")),
    "\n\nNo thinking, newlines first": (("\n\nNo thinking, newlines first", None),
                                        *((None, "\n\nNo thinking, newlines first"),) * 2),
    "": ((None, None),) * 3,
}


def _streamed(name: str, text: str, seed: int) -> tuple[str | None, str | None]:
    rng, stream, reasoning, content, pos = random.Random(seed), get_reasoning_parser(name).stream(), "", "", 0
    while pos < len(text):
        size = rng.randint(1, 6)
        r, c = stream.feed(text[pos:pos + size])
        reasoning, content, pos = reasoning + r, content + c, pos + size
    r, c = stream.finish()
    return reasoning + r or None, content + c or None


@pytest.mark.parametrize("reply", list(CASES))
def test_whole_and_streamed_splits(reply: str) -> None:
    """qwen3 reads as deepseek_r1, as current vLLM's (Qwen3-Thinking-2507 and Qwen3.5 open <think> in the prompt)."""
    for name, expected in (("deepseek_r1", CASES[reply][0]), ("qwen3", CASES[reply][0])):
        assert get_reasoning_parser(name).parse(reply) == expected, name
        assert all(_streamed(name, reply, seed) == expected for seed in range(8)), name


@pytest.mark.parametrize("reply", list(CASES))
def test_mistral_splits_as_qwen3_with_its_think_tokens(reply: str) -> None:
    """Magistral's ``[THINK]`` / ``[/THINK]`` read as glm45 reads ``<think>`` / ``</think>``, but a ``[/THINK]`` that
    nothing opened is dropped (vLLM's mistral parser, its case 3.a)."""
    magistral = reply.replace("</think>", "[/THINK]").replace("<think>", "[THINK]")
    expected = tuple(None if part is None else part.replace("</think>", "[/THINK]") for part in CASES[reply][2])
    assert get_reasoning_parser("mistral").parse(magistral) == expected
    assert all(_streamed("mistral", magistral, seed) == expected for seed in range(8))
    assert get_reasoning_parser("mistral").needs_special_tokens


@pytest.mark.parametrize(("reply", "expected"), [  # vLLM's MistralReasoningParser.extract_reasoning, case by case
    ("Hi [THINK]x[/THINK]y", ("x", "Hi y")),  # 1: text before [THINK] is content
    ("Hi [THINK]cut", ("cut", "Hi ")),  # 2: only [THINK]
    ("a[/THINK]b[/THINK]c", (None, "ab[/THINK]c")),  # 3.a: the first lone [/THINK] only
])
def test_mistral_reads_think_tokens_where_they_come(reply: str, expected: tuple[str | None, str | None]) -> None:
    assert get_reasoning_parser("mistral").parse(reply) == expected
    assert all(_streamed("mistral", reply, seed) == expected for seed in range(8))


@pytest.mark.parametrize("reply", list(CASES))
def test_glm45_minimax_m2_and_seed_oss_split_as_their_models_write(reply: str) -> None:
    """GLM-4.5 opens its thinking itself, MiniMax-M2 as deepseek_r1, Seed-OSS as deepseek_r1 with ``<seed:think>`` /
    ``</seed:think>`` (vLLM's seed_oss tests: ONLY_END_TOKEN splits, NO_TOKENS is all reasoning)."""
    for name, expected in (("glm45", CASES[reply][1]), ("minimax_m2", CASES[reply][0])):
        assert get_reasoning_parser(name).parse(reply) == expected, name
        assert all(_streamed(name, reply, seed) == expected for seed in range(4)), name
    seed = reply.replace("</think>", "</seed:think>").replace("<think>", "<seed:think>")
    expected = tuple(None if part is None else part.replace("</think>", "</seed:think>") for part in CASES[reply][0])
    assert get_reasoning_parser("seed_oss").parse(seed) == expected
    assert all(_streamed("seed_oss", seed, s) == expected for s in range(4))


def test_glm45_answer_streams_at_once() -> None:
    stream = get_reasoning_parser("glm45").stream()
    assert stream.feed("Hello") == ("", "Hello") and stream.feed(" there") == ("", " there")


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3", "minimax_m2", "glm45", "mistral"])
def test_a_prompt_that_ended_the_thinking_leaves_all_of_the_reply_content(name: str) -> None:
    """vLLM's ``is_reasoning_end(prompt_token_ids)``: the reply after ``<think>\\n\\n</think>\\n\\n`` is content."""
    parser = get_reasoning_parser(name)
    for text in ("The answer is 4.", "\nplan</think>\n\nFour.", "<think>x"):
        assert parser.parse(text, answering=True) == (None, text), text
        stream = parser.stream(answering=True)
        assert stream.feed(text[:3]) == ("", text[:3]) and stream.feed(text[3:]) == ("", text[3:])


def test_the_prompt_rule_is_the_constraints_rule() -> None:
    """One rule (start_after.py) for both: the end tag's ids within the prompt's last few tokens, not opened again
    after them (Qwen3.5: a user text ending with </think>, then the template's "assistant\n<think>\n")."""
    close = Marker((7, 8), opener=(6, 8))
    assert close.written_by([1, 2, 3, 7, 8, 9, 9])  # Qwen3 without thinking: "\n\n" after </think>
    assert not close.written_by([1, 7, 8, *[5] * 9])  # an earlier turn's </think>, far from the end
    assert not close.written_by([1, 2, 7]) and not Marker(()).written_by([7, 8])
    assert not close.written_by([1, 7, 8, 4, 5, 6, 8, 9]) and close.written_by([6, 8, 7, 8, 9])
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    think = Marker.of(tokenizer, "</think>")
    assert think.opener == tuple(tokenizer.encode("<think>", add_special_tokens=False)) != think.ids
    reply = ChatReply(tool_mode(None, None, None, None), get_reasoning_parser("deepseek_r1"),
                      stream_arguments=False, prompt_ended_thinking=True)
    deltas = reply.feed("It is 4.")
    assert merge_deltas(deltas + reply.finish("stop")[0], tools=False, reasoning_parser=True) == {
        "role": "assistant", "content": "It is 4."}


def test_thinking_off_is_all_answer_unless_the_prompt_opened_the_thinking() -> None:
    """qwen3's ``enable_thinking`` false: the reply is all answer and a grammar applies at once, unless the prompt's
    end opened ``<think>`` anyway (Qwen3-Thinking-2507's template): then it thinks until ``</think>``, the split vLLM
    makes, and the grammar waits for it. The server's parser and the engine's constraint read the one rule."""
    close = Marker((7, 8), opener=(6, 8))
    assert close.opened_by([1, 6, 8, 9]) and not close.opened_by([6, 8, 7, 8, 9]) and not close.opened_by([1, 2])
    assert close.starts_answer([1, 2], thinking_off=True) and not close.starts_answer([1, 2])
    assert not close.starts_answer([1, 6, 8, 9], thinking_off=True) and close.starts_answer([6, 8, 7, 8, 9])
    choices = Choices(2, 1, None, chat=True, reasoning=get_reasoning_parser("qwen3"), reasoning_end=close,
                      thinking_off=True)
    choices.ended_thinking(0, [1, 6, 8, 9])
    choices.ended_thinking(1, [1, 2])
    assert choices.prompt_ended_thinking == [False, True]
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    params = SamplingParams(structured=StructuredOutputs(regex="x", start_after="</think>",
                                                         start_after_only_if_opened=True))
    opened = with_start_after_ids(params, tokenizer.encode("<|assistant|><think>"), tokenizer, len(tokenizer))
    plain = with_start_after_ids(params, tokenizer.encode("<|assistant|>"), tokenizer, len(tokenizer))
    assert opened.structured.start_after_token_ids == tokenizer.encode("</think>", add_special_tokens=False)
    assert plain.structured.start_after is None and not plain.structured.start_after_token_ids
    plain.validate()  # as the core checks it: no start_after_only_if_opened left without its start_after


def test_a_mistral_or_glm_constraint_waits_only_for_a_reply_that_opens_think() -> None:
    """Magistral thinks only when its reply's first token is ``[THINK]`` (vLLM's mistral parser reads any other
    reply as all content): the server's constraint applies from the first token of a reply that does not; GLM's from
    the first token after leading whitespace (GLM-4.5 writes ``\\n<think>``); DeepSeek-R1's always waits."""
    from asyncllm.integrations.openai_protocol import ChatCompletionRequest, ServerLimits, decode_request
    from asyncllm.integrations.openai_sampling import chat_params

    body = b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}'
    req = decode_request(body, ChatCompletionRequest)
    mistral = chat_params(req, ServerLimits(), reasoning=get_reasoning_parser("mistral")).structured
    assert mistral.start_after == "[/THINK]" and mistral.start_after_only_if_reply_opens
    assert not mistral.start_after_opener_after_space
    glm = chat_params(req, ServerLimits(), reasoning=get_reasoning_parser("glm45")).structured
    assert glm.start_after_only_if_reply_opens and glm.start_after_opener_after_space
    assert (glm.start_after, glm.start_after_opener) == ("</think>", "<think>")
    assert not chat_params(req, ServerLimits(), reasoning=get_reasoning_parser("deepseek_r1")).structured \
        .start_after_only_if_reply_opens


def test_the_constraint_reads_a_prompt_with_the_servers_opener() -> None:
    """One opener (`ReasoningParser.opener`) for the server's prompt rule (`OpenAIServer.reasoning_end`) and the
    constraint's (`start_after_opener`): Hunyuan-A13B's ``<think>\\n``, not its end tag without "/"
    (``<think>\\n<answer>\\n``), so a prompt that opens the thinking again after its end tag thinks in both."""
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path
    from asyncllm.integrations.openai_protocol import ChatCompletionRequest, ServerLimits, decode_request
    from asyncllm.integrations.openai_sampling import chat_params

    tokenizer, hunyuan = AutoTokenizer.from_pretrained(bundled_model_path()), get_reasoning_parser("hunyuan_a13b")
    body = b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}'
    params = chat_params(decode_request(body, ChatCompletionRequest), ServerLimits(), reasoning=hunyuan)
    server = Marker.of(tokenizer, hunyuan.end_tag, hunyuan.end_suffix, hunyuan.end_max_between, hunyuan.opener)
    for text, answers in [("<|assistant|></think>\n<answer>\n<think>\n", False),
                          ("<|assistant|></think>\n<answer>\n", True), ("<|assistant|><think>\n", False)]:
        prompt = tokenizer.encode(text)
        structured = with_start_after_ids(params, prompt, tokenizer, len(tokenizer)).structured
        assert server.starts_answer(prompt) == answers == (structured.start_after is None), text


def test_a_marker_in_two_parts_takes_fewer_than_max_between_tokens_between() -> None:
    """gpt-oss's ``<|channel|>final`` (7, 8) ... ``<|message|>`` (9), up to 2 tokens between here (vLLM's
    openai_gptoss ``is_reasoning_end`` takes up to 20: ``<|constrain|>json``)."""
    final = Marker((7, 8), suffix=(9,), max_between=3)
    assert final.ends([1, 7, 8, 9]) and final.ends([7, 8, 4, 4, 9]) and final.ends([6, 7, 8, 4, 9])
    assert not final.ends([7, 8, 4, 4, 4, 9]) and not final.ends([7, 8, 9, 4]) and not final.ends([1, 8, 9])
    assert final.written_by([1, 7, 8, 4, 9]) and not final.written_by([1, 7, 8, 4, 5])
    assert not final.written_by([1, 7, 8, 4, 9, 5])  # a header must end the prompt itself (gpt-oss's ends there)
    assert final.spanned([1, 2, 7, 8, 4, 9, 5], opened=True) == 2
    harmony = Marker((7, 8), suffix=(9,), max_between=20)  # an earlier turn's final answer, then a user turn (6 11 9)
    previous = [6, 7, 8, 9, 1, 1, 1, 10, 6, 11, 9, 2, 2, 10, 6, 12]  # ... <|start|>assistant: not written yet
    assert not harmony.written_by(previous) and harmony.written_by(previous + [7, 8, 9])
    assert not harmony.written_by([7, 8, 9, *[1] * 9])
    assert not harmony.written_by([6, 7, 8, 9, 1, 10, 6, 12])  # "Hi", then straight to a new assistant turn
    assert Marker((7, 8)).ends([1, 7, 8]) and not Marker((7, 8)).ends([7, 8, 4, 9])  # others stay exact


def test_reasoning_tokens_are_counted_between_the_tags_as_vllm_counts_them() -> None:
    close = Marker((7, 8), opener=(6, 8))
    assert close.spanned([6, 8, 1, 2, 3, 7, 8, 4], opened=False) == 3  # the tags' own tokens not counted
    assert close.spanned([1, 2, 7, 8, 4, 4], opened=True) == 2  # the prompt opened the thinking
    assert close.spanned([1, 2, 3], opened=True) == 3 and close.spanned([1, 2, 7, 8], opened=False) == 0
    assert close.spanned([7, 8, 6, 8, 5, 5], opened=False) == 2  # an end before the opener does not end it
    harmony = get_reasoning_parser("openai_gptoss")  # its channels are not counted (docs/integrations/openai-server.md)
    assert Marker((7, 8), suffix=(9,), max_between=20).spanned([5, 5, 7, 8, 9, 1], harmony.opened_by_prompt) == 0


def test_reasoning_then_a_tool_call() -> None:
    reply = ChatReply(tool_mode([{"type": "function", "function": {"name": "f"}}], "auto", None,
                                get_tool_parser("hermes")), get_reasoning_parser("deepseek_r1"))
    text = 'I should call f.</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    deltas = [d for i in range(0, len(text), 5) for d in reply.feed(text[i:i + 5])]
    more, finish = reply.finish("stop")
    message = merge_deltas(deltas + more, tools=True)
    assert message["reasoning"] == "I should call f." and message["content"] == "\n\n"  # as written, as vLLM's
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'} and finish == "tool_calls"


def test_unknown_reasoning_parser() -> None:
    with pytest.raises(ConfigError, match="reasoning_parser.*qwen3"):
        get_reasoning_parser("o1")


def test_a_named_call_after_thoughts() -> None:
    """With a reasoning parser the server lets a tool choice's grammar start after </think>: thoughts, then the call."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    reply = ChatReply(tool_mode(tools, {"type": "function", "function": {"name": "f"}}, None, None),
                      get_reasoning_parser("deepseek_r1"))
    deltas = reply.feed("Use f.</think>") + reply.feed('{"x": 1}')  # the grammar starts right after </think>
    more, finish = reply.finish("stop")
    message = merge_deltas(deltas + more, tools=True)
    assert message["reasoning"] == "Use f." and message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'


@pytest.mark.parametrize(("reply", "expected"), [  # vLLM's tests/reasoning/test_hunyuan_reasoning_parser.py
    ("<think>\n\n</think>\n<answer>\nThis is the rest\n</answer>", (None, "This is the rest")),  # a quick thought
    ("<think>\nThis is a reasoning section\n</think>\n<answer>\nThis is the rest\n</answer>",
     ("This is a reasoning section", "This is the rest")),
    ("<think>\nThis is a reasoning section!\n</think>\n<answer>\n", ("This is a reasoning section!", None)),
    ("This is content", (None, "This is content")),
    ("<think>\nThis\nThat\n</think>\n<answer>\nThis is the rest\nThat", ("This\nThat", "This is the rest\nThat")),
    ("<think>\nx\n</think>\n<answer>\nhalf\n</ans", ("x", "half\n</ans")),  # cut short: held back, then content
    ("<think>\n</think>\n<answer>\nX\n</answer>", (None, "X")),  # an empty thought without its blank line
    ("<think>\nx</think>\n<answer>\nX", ("x</think>\n<answer>\nX", None)),  # only right after <think>\n
])
def test_hunyuan_a13b_markers_hold_their_newlines(reply: str, expected: tuple[str | None, str | None]) -> None:
    """vLLM's markers: ``<think>\\n`` and ``\\n</think>\\n<answer>\\n``, the answer up to ``\\n</answer>``."""
    assert get_reasoning_parser("hunyuan_a13b").parse(reply) == expected
    assert all(_streamed("hunyuan_a13b", reply, seed) == expected for seed in range(8))


def test_qwen3_thinking_ends_at_a_call_made_inside_it() -> None:
    """Qwen3.5 may call a tool without closing its thinking: vLLM's qwen3 parser ends the reasoning at a
    ``<tool_call>`` that ``<function`` follows (a mere mention of the tag stays reasoning)."""
    call = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    for text, expected in ((f"Call f.\n{call}", ("Call f.\n", call)), ("a <tool_call> b", ("a <tool_call> b", None)),
                           (f"a <tool_call> b </think>{call}", ("a <tool_call> b ", call))):
        assert get_reasoning_parser("qwen3").parse(text) == expected
        assert all(_streamed("qwen3", text, seed) == expected for seed in range(8))
    reply = ChatReply(tool_mode([{"type": "function", "function": {"name": "f"}}], "auto", None,
                                get_tool_parser("qwen3_coder")), get_reasoning_parser("qwen3"))
    deltas = [d for i in range(0, len(call) + 8, 3) for d in reply.feed(f"Call f.\n{call}"[i:i + 3])]
    message = merge_deltas(deltas + reply.finish("stop")[0], tools=True)
    assert message["reasoning"] == "Call f.\n" and message["tool_calls"][0]["function"]["arguments"] == '{"x": "1"}'


def test_qwen3_reads_whitespace_after_a_tool_call_tag_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``<tool_call>`` in the thinking is held while only whitespace follows it (a ``<function`` may still come);
    each piece of that whitespace is read once, not the whole held text again (a model looping on whitespace there
    cost the event loop 7 s of CPU over 32k tokens: quadratic time)."""
    from asyncllm import reasoning

    read = [0]
    pattern = reasoning.Qwen3ReasoningStream._FUNCTION

    class Counted:
        def match(self, text: str) -> object:
            read[0] += len(text)
            return pattern.match(text)

    monkeypatch.setattr(reasoning.Qwen3ReasoningStream, "_FUNCTION", Counted())
    stream, out, pieces = get_reasoning_parser("qwen3").stream(), [], 3000
    for text in ["I may call <tool_call>", *["  "] * pieces, "\n<function=f>", "</think>"]:
        out.append(stream.feed(text))
    out.append(stream.finish())
    reasoning_text, content = ("".join(part[i] for part in out) for i in (0, 1))
    assert reasoning_text == "I may call " and content == "<tool_call>" + "  " * pieces + "\n<function=f></think>"
    assert read[0] < 20 * pieces


@pytest.mark.parametrize("name", ["deepseek_r1", "glm45", "hunyuan_a13b"])
def test_leading_whitespace_is_read_once(name: str) -> None:
    """While only whitespace has come, a reply is not yet known to open ``<think>``: each new piece of that
    whitespace is read once, not the whole held text again (quadratic time on the event loop)."""
    read = [0]

    class Counted(str):  # the stream's buffer, counting the characters stripped from it
        def __add__(self, other: str) -> "Counted":
            return Counted(str(self) + other)

        def lstrip(self, chars: str | None = None) -> str:
            read[0] += len(self)
            return str.lstrip(self, chars)

    parser, pieces = get_reasoning_parser(name), 3000
    stream = parser.stream()
    stream._buffer = Counted()
    out = [stream.feed(text) for text in ["\n", *["  "] * pieces, f"{parser.start_tag}a{stream._close}b"]]
    out.append(stream.finish())
    assert ("".join(part[0] for part in out), "".join(part[1] for part in out)) == ("a", "b")
    assert read[0] < 20 * pieces
