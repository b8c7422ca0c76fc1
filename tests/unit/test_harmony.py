"""gpt-oss's harmony replies: the ``openai_gptoss`` reasoning parser and the ``openai`` tool-call parser, whole and
cut into deltas at every point (markers split anywhere), alone and together in `ChatReply`."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.errors import ConfigError
from asyncllm.harmony import FINAL_START, parse_header
from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.reasoning import get_reasoning_parser
from asyncllm.tool_calls import check_parser_pair, get_tool_parser

TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "add")]
A = "<|channel|>analysis<|message|>{}<|end|>"
NEXT_A = "<|start|>assistant<|channel|>analysis<|message|>{}<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>{}<|return|>"
CALL = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
ROLE_CALL = "<|start|>assistant to=functions.{}<|channel|>commentary json<|message|>{}<|call|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>{}<|end|>"
PARIS = '{"city": "Paris \\"centre\\"", "days": [1, 2.50]}'

REPLIES = {  # name: (reply, reasoning, content, calls as (name, arguments))
    "answer": (A.format("2+2 is 4.") + FINAL.format("It is 4."), "2+2 is 4.", "It is 4.", []),
    "call": (A.format("Need the weather.") + CALL.format("get_weather", PARIS), "Need the weather.", None,
             [("get_weather", json.dumps(json.loads(PARIS)))]),
    "calls with analysis between": (
        A.format("First Paris.") + CALL.format("get_weather", '{"city":"Paris"}') + NEXT_A.format("Then add.")
        + ROLE_CALL.format("add", '{"a": 1,\n "b": -0.5e1}'), "First Paris.\nThen add.", None,
        [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": -5.0}')]),
    "preamble then call then answer": (
        PREAMBLE.format("Let me check.") + CALL.format("get_weather", "{}") + FINAL.format("Sunny."), None,
        "Let me check.\nSunny.", [("get_weather", "{}")]),
    "first message a call, recipient in its role part": (
        ' to=functions.add<|channel|>commentary json<|message|>{"a": 2}<|call|>', None, None, [("add", '{"a": 2}')]),
    "cut short while thinking": ("<|channel|>analysis<|message|>still thinking", "still thinking", None, []),
    "no markers at all": ("Plain text, < and | too.", None, "Plain text, < and | too.", []),
    "a header broken by an end marker is text": (
        "<|start|>assistant<|channel|>final<|end|>" + FINAL.format("Ok."), None,
        "<|start|>assistant<|channel|>final<|end|>Ok.", []),
    "empty": ("", None, None, []),
}
PASSED_ON = {  # the reasoning parser's content where there are calls: they pass on as written, for the tool parser
    "call": CALL.format("get_weather", PARIS),
    "calls with analysis between": (CALL.format("get_weather", '{"city":"Paris"}')
                                    + ROLE_CALL.format("add", '{"a": 1,\n "b": -0.5e1}')),
    "preamble then call then answer": "Let me check." + CALL.format("get_weather", "{}") + "\nSunny.",
    "first message a call, recipient in its role part": REPLIES["first message a call, recipient in its role part"][0],
}
BROKEN_CALLS = {  # the call message is content, as written (the reasoning parser leaves it for the tool parser)
    "JSON then more": CALL.format("get_weather", '{"city": "Paris"} and Rome'),
    "not JSON after {": CALL.format("get_weather", "{city: Paris}"),
    "not JSON, cut short": CALL.format("get_weather", "Paris").removesuffix("<|call|>"),
    "empty": CALL.format("get_weather", " "),
    "cut short": CALL.format("get_weather", '{"city": "Par').removesuffix("<|call|>"),
    "no name": CALL.format("", "{}"),
    "a built-in tool": '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>',
}


def _cuts(text: str) -> list[list[str]]:
    """The reply in two pieces at every point, one character at a time, and in random pieces."""
    rng = random.Random(len(text))
    randoms = []
    for _ in range(4):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12))) if len(text) > 1 else []
        randoms.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    return [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)] + randoms


def _reasoning(pieces: list[str]) -> tuple[str | None, str | None]:
    stream, reasoning, content = get_reasoning_parser("openai_gptoss").stream(), "", ""
    for piece in [*pieces, None]:
        r, c = stream.feed(piece) if piece is not None else stream.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


def _reply(pieces: list[str], stream_arguments: bool = True, parallel: bool | None = None,
           finish_reason: str = "stop") -> tuple[list[dict], str | None]:
    reply = ChatReply(tool_mode(TOOLS, "auto", parallel, get_tool_parser("openai")),
                      get_reasoning_parser("openai_gptoss"), stream_arguments)
    deltas = [d for piece in pieces for d in reply.feed(piece)]
    more, finish = reply.finish(finish_reason)
    return deltas + more, finish


def _message(deltas: list[dict]) -> dict:
    message = merge_deltas(deltas, tools=True)
    for call in message.get("tool_calls", ()):
        assert call.pop("id").startswith("call_")
    return message


def _expected(reasoning: str | None, content: str | None, calls: list[tuple[str, str]]) -> dict:
    message: dict = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return message


@pytest.mark.parametrize("name", list(REPLIES))
def test_reasoning_parser_whole_and_at_every_cut(name: str) -> None:
    reply, reasoning, content, _ = REPLIES[name]
    content = PASSED_ON.get(name, content)
    assert get_reasoning_parser("openai_gptoss").parse(reply) == (reasoning, content)
    for pieces in _cuts(reply):
        assert _reasoning(pieces) == (reasoning, content), pieces


@pytest.mark.parametrize("name", list(REPLIES))
def test_reasoning_and_calls_whole_and_at_every_cut(name: str) -> None:
    reply, reasoning, content, calls = REPLIES[name]
    expected = _expected(reasoning, content, calls)
    deltas, finish = _reply([reply], stream_arguments=False)
    assert _message(deltas) == expected and finish == ("tool_calls" if calls else "stop")
    for pieces in _cuts(reply):
        deltas, finish = _reply(pieces)
        assert _message(deltas) == expected and finish == ("tool_calls" if calls else "stop"), pieces


def test_arguments_stream_as_generated() -> None:
    reply = A.format("Weather.") + CALL.format("get_weather", PARIS)
    deltas, _ = _reply(list(reply))
    items = [item for d in deltas for item in d.get("tool_calls", ())]
    assert items[0]["function"] == {"name": "get_weather", "arguments": ""}  # once the header is read
    pieces = [item["function"]["arguments"] for item in items[1:]]
    assert len(pieces) > 10 and "".join(pieces) == json.dumps(json.loads(PARIS))
    assert not any("content" in d and d["content"] for d in deltas)


@pytest.mark.parametrize("name", list(BROKEN_CALLS))
def test_a_message_that_is_not_a_call_stays_content(name: str) -> None:
    message = BROKEN_CALLS[name]
    reply = A.format("Hmm.") + message
    assert get_reasoning_parser("openai_gptoss").parse(reply) == ("Hmm.", message)
    parsed = get_tool_parser("openai").parse(message)
    assert parsed.content == message and parsed.tool_calls == []
    whole, finish = _reply([reply], stream_arguments=False)
    assert _message(whole) == {"role": "assistant", "content": message, "reasoning": "Hmm."} and finish == "stop"
    for pieces in _cuts(reply):  # streamed: a functions call's first piece went out; its text is content too
        deltas, finish = _reply(pieces)
        assert "".join(d.get("content", "") for d in deltas) == message and finish == "stop", pieces


@pytest.mark.parametrize("body, arguments", [("Paris", "Paris"), ("city=Paris\nunit=C", "city=Paris\nunit=C"),
                                             (" [1,2] ", "[1, 2]"), ('"x"', '"x"'), ("null", "null")])
def test_a_call_whose_body_does_not_start_with_a_brace_passes_it_on_as_vllm(body: str, arguments: str) -> None:
    """vLLM's ``openai`` parser: a ``functions.`` message's body that json.loads refuses is the arguments as written
    (other JSON: ``json.dumps`` of it); here it was content, the message's text with its markers. Streamed, the
    arguments come whole at the message's end."""
    reply = A.format("Hmm.") + CALL.format("get_weather", body)
    parsed = get_tool_parser("openai").parse(CALL.format("get_weather", body))
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", arguments)]
    assert parsed.content is None
    expected = _expected("Hmm.", None, [("get_weather", arguments)])
    whole, finish = _reply([reply], stream_arguments=False)
    assert _message(whole) == expected and finish == "tool_calls"
    for pieces in _cuts(reply):
        deltas, finish = _reply(pieces)
        assert _message(deltas) == expected and finish == "tool_calls", pieces


def test_a_broken_call_between_good_ones_keeps_the_indexes() -> None:
    reply = CALL.format("add", "{}") + CALL.format("add", "{nope}") + CALL.format("get_weather", "{}")
    parsed = get_tool_parser("openai").parse(reply)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("add", "{}"), ("get_weather", "{}")]
    assert parsed.content == CALL.format("add", "{nope}")
    deltas, _ = _reply(list(reply))
    indexes = [item["index"] for d in deltas for item in d.get("tool_calls", ()) if "id" in item]
    assert indexes == [0, 1, 2]  # streamed, the broken call's first piece was sent: the next call is number 2


def test_not_parallel_keeps_the_first_call() -> None:
    deltas, finish = _reply([REPLIES["calls with analysis between"][0]], stream_arguments=False, parallel=False)
    assert [c["function"]["name"] for c in _message(deltas)["tool_calls"]] == ["get_weather"] and finish == "tool_calls"


def test_tool_parser_alone_reads_calls_and_keeps_the_rest_as_written() -> None:
    reply = REPLIES["calls with analysis between"][0]
    parsed = get_tool_parser("openai").parse(reply)
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "add"]
    assert parsed.content == A.format("First Paris.") + NEXT_A.format("Then add.")


def test_headers() -> None:
    assert parse_header("<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
                        ).recipient == "functions.f"
    header = parse_header("<|start|>assistant to=functions.g<|channel|>commentary json<|message|>")
    assert (header.channel, header.recipient) == ("commentary", "functions.g")
    assert (parse_header("<|channel|>final<|message|>").channel, parse_header("<|message|>").channel) == ("final", None)


def test_what_the_server_reads() -> None:
    """Special tokens kept (the markers are special tokens); a constraint starts with the final message; the tool
    parser only after openai_gptoss."""
    reasoning, tools = get_reasoning_parser("openai_gptoss"), get_tool_parser("openai")
    assert reasoning.needs_special_tokens and tools.needs_special_tokens and not reasoning.forced_tool_calls
    assert (reasoning.end_tag, reasoning.end_suffix, reasoning.end_max_between) == ("<|channel|>final", "<|message|>", 20)
    assert reasoning.end_tag + reasoning.end_suffix == FINAL_START
    assert not get_reasoning_parser("qwen3").needs_special_tokens
    check_parser_pair(tools, "openai_gptoss")
    check_parser_pair(get_tool_parser("hermes"), None)
    for other in (None, "qwen3"):
        with pytest.raises(ConfigError, match="reasoning_parser.*openai_gptoss"):
            check_parser_pair(tools, other)


FRAGMENTS = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.add",
             " to=browser.search", " ", "<|constrain|>", "json", "<|message|>", '{"a": 1}', "{", "}", "text", "\n",
             "<|end|>", "<|call|>", "<|return|>", "<|", "<", "|>", "é"]


@settings(max_examples=200, deadline=None)
@given(reply=st.lists(st.sampled_from(FRAGMENTS), max_size=16).map("".join),
       cuts=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=30))
def test_any_text_in_any_pieces_reads_as_whole(reply: str, cuts: list[int]) -> None:
    """Whatever the text (broken markers included), streamed equals whole, and without calls nothing is lost."""
    pieces, pos = [], 0
    while pos < len(reply):
        pieces.append(reply[pos:pos + cuts[len(pieces) % len(cuts)]])
        pos += len(pieces[-1])
    assert _reasoning(pieces) == get_reasoning_parser("openai_gptoss").parse(reply)
    whole, _ = _reply([reply], stream_arguments=False)
    streamed, _ = _reply(pieces, stream_arguments=False)
    assert _message(streamed) == _message(whole)
    stream, content, calls = get_tool_parser("openai").stream(), "", []
    for text, new in [*map(stream.feed, pieces), stream.finish()]:
        content, calls = content + text, calls + new
    assert content == reply if not calls else [c.name for c in calls] == ["add"] * len(calls)


RESPONSES_ITEMS = {  # name: (reasoning parser, tools, reply, the Responses API's items as (type, text or call name))
    "analysis, preamble, analysis, final": ("openai_gptoss", False, A.format("think A") + PREAMBLE.format(
        "Let me check.") + NEXT_A.format("think B") + FINAL.format("Done."), [
        ("reasoning", "think A"), ("message", "Let me check."), ("reasoning", "think B"), ("message", "Done.")]),
    "analysis, final": ("openai_gptoss", False, REPLIES["answer"][0],
                        [("reasoning", "2+2 is 4."), ("message", "It is 4.")]),
    "two analyses, a call": ("openai_gptoss", True, A.format("a") + NEXT_A.format("b") + CALL.format("add", "{}"),
                             [("reasoning", "a"), ("reasoning", "b"), ("function_call", "add")]),
    "a preamble ending in '<', with tools": (  # the tool stream's held-back '<' stays in its message's item
        "openai_gptoss", True, A.format("t") + PREAMBLE.format("a <") + NEXT_A.format("r") + FINAL.format("b"),
        [("reasoning", "t"), ("message", "a <"), ("reasoning", "r"), ("message", "b")]),
    "tags: reasoning, content": ("deepseek_r1", False, "<think>A\nB</think>\nC\n\nD",
                                 [("reasoning", "A\nB"), ("message", "\nC\n\nD")]),
}


@pytest.mark.parametrize("name", RESPONSES_ITEMS)
def test_responses_items_one_per_message_streamed_or_not(name: str) -> None:
    """The Responses API's output items are the same streamed (in any pieces) or whole: one per harmony message,
    with no newline joining them (a chat message's reasoning and content join them: `REPLIES`)."""
    from asyncllm.integrations.responses_api import ResponseEvents, ResponsesRequest, response_body

    parser, tools, text, expected = RESPONSES_ITEMS[name]
    mode = tool_mode(TOOLS, "auto", None, get_tool_parser("openai")) if tools else tool_mode(None, None, None, None)
    req, usage = ResponsesRequest(model="m", input="hi"), {"prompt_tokens": 1, "completion_tokens": 1,
                                                           "total_tokens": 2}

    def items(body: dict) -> list[tuple[str, str]]:
        return [(o["type"], o["name"] if o["type"] == "function_call" else o["content"][0]["text"])
                for o in body["output"]]

    whole = ChatReply(mode, get_reasoning_parser(parser), stream_arguments=False, message_starts=True)
    deltas = whole.feed(text)
    more, finish = whole.finish("stop")
    assert items(response_body(req, "m", deltas + more, finish, usage)) == expected
    for pieces in [list(text), *_cuts(text)[-4:]]:
        reply, events = ChatReply(mode, get_reasoning_parser(parser), message_starts=True), ResponseEvents(req, "m")
        for piece in pieces:
            events.feed(reply.feed(piece))
        more, finish = reply.finish("stop")
        events.feed(more)
        events.finish(finish, usage)
        assert items(events.body) == expected


def test_every_reasoning_stream_gives_parts_and_harmony_keeps_its_messages_apart_when_asked() -> None:
    """`ChatReply` reads any parser's stream alike (`feed_parts`): a tag parser's reply is one message (reasoning,
    then content); harmony's messages come apart, each starting, only with `apart` (the Responses API's)."""
    tag = get_reasoning_parser("deepseek_r1").stream(apart=True)
    assert tag.feed_parts("a</think>b") + tag.finish_parts() == [("reasoning", "a", False), ("content", "b", False)]
    text = "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>analysis<|message|>y<|end|>"
    joined, apart = (get_reasoning_parser("openai_gptoss").stream(apart=a) for a in (False, True))
    assert joined.feed_parts(text) + joined.finish_parts() == [("reasoning", "x\ny", False)]
    assert apart.feed_parts(text) + apart.finish_parts() == [("reasoning", "x", True), ("reasoning", "y", True)]


def test_a_long_header_is_searched_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header that never reaches its ``<|message|>`` (a model looping inside one) is searched for its markers once
    per piece's new text, not again from its start at every piece (quadratic time on the server's event loop)."""
    from asyncllm import harmony

    searched = [0]
    earliest = harmony._earliest

    def counted(text: str, markers: tuple[str, ...], skip: int = 0) -> tuple[str | None, int]:
        searched[0] += len(text) - skip
        return earliest(text, markers, skip)

    monkeypatch.setattr(harmony, "_earliest", counted)
    pieces = 3000
    reply = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis" + " x" * pieces + \
        "<|message|>b<|end|>"
    stream, parts = get_reasoning_parser("openai_gptoss").stream(), []
    for start in range(0, len(reply), 3):
        parts.append(stream.feed(reply[start:start + 3]))
    parts.append(stream.finish())
    assert "".join(p[0] for p in parts) == "a\nb"
    assert searched[0] < 50 * pieces
