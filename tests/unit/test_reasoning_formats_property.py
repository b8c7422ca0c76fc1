"""The tag reasoning parsers (asyncllm/reasoning.py) with their own markers, against a naive reading of their docs.

Parsers: ``deepseek_r1``, ``minimax_m2``, ``qwen3`` (``<think>`` / ``</think>``), ``seed_oss`` (``<seed:think>`` /
``</seed:think>``), ``glm45`` (``<think>`` / ``</think>``, opened by the reply), ``hunyuan_a13b`` (``<think>\\n`` /
``\\n</think>\\n<answer>\\n``, the answer up to ``\\n</answer>``) and ``mistral`` (``[THINK]`` / ``[/THINK]``);
``openai_gptoss`` is test_harmony_property.py's. Each reply is read in one of three modes: ``plain``, ``opened``
(the prompt's end opened the thinking: `ReasoningParser.stream`'s ``opened``) and ``answering`` (the prompt's end
ended it: ``answering``).

The model (`reference`), from the module's docstring and docs/integrations/openai-server.md's table, reads the reply
split on the parser's markers: ``answering``, all of it is content. Otherwise ``mistral`` (not ``opened``) reads
content up to the first ``[THINK]`` (wherever it comes, its first ``[/THINK]`` dropped), reasoning up to the next
``[/THINK]``, content after. The others think when the template opens the thinking (deepseek_r1, qwen3, minimax_m2,
seed_oss), when ``opened``, or when the reply opens it (after leading whitespace, both dropped); a reply that does
not think is all content, as written. A thinking reply is reasoning up to the first end marker (all of it when cut
short), content after, as written; qwen3's reasoning also ends at a ``<tool_call>`` that ``<function`` follows
(after whitespace; ``<function`` then ``=`` or whitespace), the call being content; hunyuan_a13b's end marker without
its first newline, right after the start marker, ends an empty thought, and its content stops at ``\\n</answer>``.

Drawn: well-formed replies (leading whitespace, the opening marker or not, thinking text, the end marker or a reply
cut while thinking, content holding start and end markers, ``<``, ``[``, unicode, pieces of markers; mistral's
content before ``[THINK]``; hunyuan's ``\\n</answer>`` and what follows it), any concatenation of the parser's markers,
their pieces and text, cut anywhere (max_tokens), each fed whole and in pieces of 1-9 characters (markers split
anywhere); and replies that think, call a tool inside the thinking and / or after it, read through `ChatReply` with
the tool-call parser of the model family (qwen3 + hermes and qwen3_coder, deepseek_r1 + deepseek_v3, mistral,
glm45, minimax_m2, seed_oss, hunyuan_a13b with their own).

Checked: for well-formed replies the model gives the drawn thinking and content (no marker leaks); ``parse`` gives the
model's reading; streamed, after every piece what came out is exactly what every reply starting with the text so far
reads as (the common start of the model's readings over continuations: none, other text, each marker and the rest of
each marker the text ends inside), so only a possible marker's start is held back, and ``feed_parts`` gives the same
as its parts; at the end the model's reading. Chained, the reasoning is the model's and the calls are exactly those
in the model's content (one inside the thinking is reasoning, except qwen3's ``<tool_call><function=``, which ends
it), whole and streamed alike. The parsers' documented attributes (`opener`, `thinking_off`, the flags) and the
registry's refusal of an unknown name.

Set ``REASONING_FORMATS_NO_SHRINK=1`` to skip shrinking and the example database (the mutation runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import Phase, assume, example, given, settings
from hypothesis import strategies as st

from asyncllm.errors import ConfigError
from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.reasoning import REASONING_PARSERS, get_reasoning_parser
from asyncllm.tool_calls import get_tool_parser
from test_harmony_property import pieces_of

PHASES = {"phases": [Phase.explicit, Phase.generate], "database": None} if os.environ.get(
    "REASONING_FORMATS_NO_SHRINK") else {}
MODES = ("plain", "opened", "answering")


# ----------------------------------------------------------------------------------------------------------------
# The model: each parser's markers and rules, as the docs give them.


@dataclass(frozen=True)
class Format:
    """A parser's markers: `start` and `end` of the thinking; `by_template`: the chat template opens the thinking
    (the reply is reasoning up to `end` however it starts); `anywhere`: mistral's, `start` opens the thinking wherever
    it comes; `answer_end`: hunyuan's, the content stops there; `calls_end`: qwen3's, a call ends the thinking."""

    start: str
    end: str
    by_template: bool
    anywhere: bool = False
    answer_end: str = ""
    calls_end: bool = False

    def answer(self, text: str) -> str:
        """The content of answer text: up to `answer_end` (hunyuan), else all of it, as written."""
        return text.split(self.answer_end)[0] if self.answer_end else text

    @property
    def markers(self) -> list[str]:
        """Every text that changes the reading where it comes."""
        extra = [self.answer_end, self.end[1:], "<answer>\n"] if self.answer_end else []
        calls = ["<tool_call>", "<function=", "<function ", "<tool_call>\n<function=f>"] if self.calls_end else []
        return [self.start, self.end, *extra, *calls]


FORMATS = {
    "deepseek_r1": Format("<think>", "</think>", by_template=True),
    "minimax_m2": Format("<think>", "</think>", by_template=True),
    "qwen3": Format("<think>", "</think>", by_template=True, calls_end=True),
    "seed_oss": Format("<seed:think>", "</seed:think>", by_template=True),
    "glm45": Format("<think>", "</think>", by_template=False),
    "hunyuan_a13b": Format("<think>\n", "\n</think>\n<answer>\n", by_template=False, answer_end="\n</answer>"),
    "mistral": Format("[THINK]", "[/THINK]", by_template=False, anywhere=True),
}
NAMES = sorted(FORMATS)


def call_inside(thought: str) -> int:
    """qwen3: where the first ``<tool_call>`` followed (after whitespace) by ``<function=`` or ``<function`` and a
    space is, -1 if none."""
    for at in (i for i in range(len(thought)) if thought.startswith("<tool_call>", i)):
        rest = thought[at + len("<tool_call>"):].lstrip()
        if rest.startswith("<function=") or rest.startswith("<function") and rest[len("<function"):][:1].isspace():
            return at
    return -1


def mistral_reading(f: Format, reply: str) -> tuple[str, str]:
    """Content up to ``[THINK]`` (its first ``[/THINK]`` dropped), reasoning up to ``[/THINK]``, content after."""
    before, opener, after = reply.partition(f.start)
    before = before.replace(f.end, "", 1)
    if not opener:
        return "", before
    reasoning, _, content = after.partition(f.end)
    return reasoning, before + content


def reference(name: str, reply: str, mode: str = "plain") -> tuple[str, str]:
    """(reasoning, content) of a whole reply, "" where there is none."""
    f = FORMATS[name]
    if mode == "answering":
        return "", f.answer(reply)
    if f.anywhere and mode == "plain":
        return mistral_reading(f, reply)
    opens = reply.lstrip().startswith(f.start)
    if not (opens or f.by_template or mode == "opened"):
        return "", f.answer(reply)
    thought = reply.lstrip()[len(f.start):] if opens else reply
    if f.answer_end and thought.startswith(f.end[1:]):  # hunyuan: an empty thought, its end without the newline
        return "", f.answer(thought[len(f.end) - 1:])
    ends = [at for at in (thought.find(f.end), call_inside(thought) if f.calls_end else -1) if at >= 0]
    if not ends:
        return thought, ""
    at = min(ends)
    after = thought[at:] if at == call_inside(thought) and f.calls_end else thought[at + len(f.end):]
    return thought[:at], f.answer(after)


def continuations(name: str, seen: str) -> list[str]:
    """What may come after `seen` that changes its reading: nothing, other text, each marker, and the rest of each
    marker `seen` ends inside."""
    out = ["", "x", " x"]
    for marker in FORMATS[name].markers:
        out += [marker[size:] for size in range(len(marker)) if seen.endswith(marker[:size])]
    return out


def common_start(texts: list[str]) -> str:
    return os.path.commonprefix(texts)


def certain(name: str, seen: str, mode: str) -> tuple[str, str]:
    """What every reply that starts with `seen` reads as so far: the common start of the readings."""
    readings = [reference(name, seen + more, mode) for more in continuations(name, seen)]
    return common_start([r for r, _ in readings]), common_start([c for _, c in readings])


# ----------------------------------------------------------------------------------------------------------------
# The parsers, driven.




def check_stream(name: str, pieces: list[str], mode: str) -> None:
    """After every piece exactly what is certain of the text so far is out (reasoning and content), `feed_parts`
    the same as parts; at the end the model's reading of the whole reply."""
    parser = get_reasoning_parser(name)
    stream = parser.stream(answering=mode == "answering", opened=mode == "opened")
    parts = parser.stream(answering=mode == "answering", opened=mode == "opened")
    reasoning, content, seen = "", "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        assert parts.feed_parts(piece) == [(k, t, False) for k, t in (("reasoning", r), ("content", c)) if t]
        reasoning, content, seen = reasoning + r, content + c, seen + piece
        assert (reasoning, content) == certain(name, seen, mode), (seen, mode)
    r, c = stream.finish()
    assert parts.finish_parts() == [(k, t, False) for k, t in (("reasoning", r), ("content", c)) if t]
    assert (reasoning + r, content + c) == reference(name, seen, mode)


def check_all(name: str, reply: str, mode: str, sizes: list[int]) -> None:
    """``parse`` and the stream, whole and in the drawn pieces, read what the model reads."""
    reasoning, content = reference(name, reply, mode)
    parsed = get_reasoning_parser(name).parse(reply, answering=mode == "answering", opened=mode == "opened")
    assert parsed == (reasoning or None, content or None), (reply, mode)
    for pieces in ([reply], pieces_of(reply, sizes)):
        check_stream(name, pieces, mode)


# ----------------------------------------------------------------------------------------------------------------
# Drawn replies.

TEXT = ["a", "Paris", "2+2=4.", " ", "\n", "\n\n", "<", "[", "]", "/", ">", "=", "é", "Ω", "😀", "\u00a0", "\t",
        "<think>", "</think>", "[THINK]", "[/THINK]", "<seed:think>", "</seed:think>", "<answer>", "</answer>",
        "<tool_call>", "<function=f>", "<function", "[TOOL_CALLS]"]
"""Text: markers of every parser (a parser's own are filtered out of well-formed parts), brackets, unicode."""


def marker_pieces(name: str) -> list[str]:
    """The parser's markers and their starts and ends (a marker split anywhere)."""
    markers = FORMATS[name].markers
    return sorted({m[:k] for m in markers for k in range(1, len(m))} | {m[k:] for m in markers for k in
                                                                          range(1, len(m))} | set(markers))


def free_text(name: str, max_size: int = 8, markers: bool = True) -> st.SearchStrategy[str]:
    """Any text: drawn text, the parser's markers' pieces and (as often as the rest) `markers` whole."""
    pieces = st.sampled_from(TEXT + marker_pieces(name))
    return st.lists(pieces | st.sampled_from(FORMATS[name].markers) if markers else pieces,
                    max_size=max_size).map("".join)


def plain_text(name: str) -> st.SearchStrategy[str]:
    """Text that holds none of the parser's markers (their pieces, other parsers' markers allowed)."""
    f = FORMATS[name]
    own = [m for m in (f.start, f.end, f.answer_end) if m]
    return free_text(name, 6, markers=False).filter(lambda t: not any(m in t for m in own))


@dataclass(frozen=True)
class Case:
    """A drawn reply, its mode, and the reasoning and content it was drawn with."""

    name: str
    mode: str
    reply: str
    reasoning: str
    content: str


@st.composite
def well_formed(draw: st.DrawFn) -> Case:
    """A reply as its model writes it: (content before mistral's ``[THINK]``), leading whitespace, the opening
    marker or not, thinking text, the end marker (or the reply cut short while thinking), content (markers in it
    too), hunyuan's ``\\n</answer>`` and what follows it; or, ``answering`` or not thinking, all answer."""
    name, mode = draw(st.sampled_from(NAMES)), draw(st.sampled_from(MODES))
    f = FORMATS[name]
    lead = draw(st.sampled_from(["", "\n", "\n\n", " "]))
    content = draw(free_text(name).filter(lambda t: not f.answer_end or f.answer_end not in "\n" + t))
    tail = f.answer_end + draw(free_text(name, 3)) if f.answer_end and draw(st.booleans()) else ""
    thinks = mode != "answering" and (f.by_template or mode == "opened" or draw(st.booleans()))
    if not thinks:
        answer = lead + draw(plain_text(name)) + (content if mode == "answering" else "")
        assume(not (f.answer_end and f.answer_end in answer))
        assume(mode == "answering" or not (answer + tail).lstrip().startswith(f.start))
        return Case(name, mode, answer + tail, "", answer)
    before = lead + draw(plain_text(name)) if f.anywhere and mode == "plain" else ""  # Magistral: content first
    writes_start = bool(before) or not (f.by_template or mode == "opened") or draw(st.booleans())
    thinking = draw(plain_text(name).filter(lambda t: call_inside(t + f.end) < 0 and (t + f.end).find(f.end) == len(t)))
    ending = f.end + content + tail if draw(st.booleans()) else ""  # or cut short while thinking (max_tokens)
    if not writes_start:
        thinking = lead + thinking
        if thinking.lstrip().startswith(f.start):
            thinking = "x" + thinking
        assume((thinking + f.end).find(f.end) == len(thinking))  # the lead may complete hunyuan's "\n</think>..."
    if f.answer_end and (thinking + ending).startswith(f.end[1:]):  # not hunyuan's empty thought
        thinking = "x" + thinking
    reply = ((before or lead) + f.start if writes_start else "") + thinking
    return Case(name, mode, reply + ending, thinking, before + (content if ending else ""))


@st.composite
def any_reply(draw: st.DrawFn) -> tuple[str, str, str]:
    """(name, mode, reply): the parser's markers, their pieces and text in any order, maybe cut anywhere; the mode
    ``plain`` half of the time (the parsers differ most there)."""
    name = draw(st.sampled_from(NAMES))
    reply = draw(free_text(name, 12))
    mode = draw(st.sampled_from(("plain", "plain", "opened", "answering")))
    return name, mode, reply[:draw(st.integers(0, len(reply)))] if draw(st.booleans()) else reply


sizes_ = st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=12)


# ----------------------------------------------------------------------------------------------------------------
# The properties.


@settings(max_examples=300, deadline=None, **PHASES)
@given(case=well_formed(), sizes=sizes_)
# Magistral: text before [THINK] is content, a [THINK] in the content after [/THINK] stays content
@example(case=Case("mistral", "plain", "Hi [THINK]plan [/THINK]Done [THINK]x[/THINK].", "plan ",
                   "Hi Done [THINK]x[/THINK]."), sizes=[3])
# Seed-OSS: the reply opens its own marker (dropped with the whitespace before it); several end markers
@example(case=Case("seed_oss", "plain", "\n<seed:think>a<b</seed:think>c</seed:think>d", "a<b", "c</seed:think>d"),
         sizes=[4])
# Hunyuan: an empty thought written without its blank line; the answer stops at \n</answer>
@example(case=Case("hunyuan_a13b", "plain", "<think>\n</think>\n<answer>\nX\n</answer>\nbye", "", "X"), sizes=[1])
# Hunyuan: a reply that does not think is all answer, up to \n</answer>
@example(case=Case("hunyuan_a13b", "plain", "\nJust 4.\n</answer>", "", "\nJust 4."), sizes=[2])
# GLM-4.5 writes \n<think>; GLM-4.7's prompt opened it: the reply thinks until </think>
@example(case=Case("glm45", "plain", "\n<think>é</think>\n\nΩ", "é", "\n\nΩ"), sizes=[2, 7])
@example(case=Case("glm45", "opened", "plan</think>4", "plan", "4"), sizes=[5])
# a prompt that ended the thinking: all content, markers and all
@example(case=Case("deepseek_r1", "answering", "<think>a</think>b", "", "<think>a</think>b"), sizes=[1])
# cut short while thinking (max_tokens) inside the end marker: all reasoning
@example(case=Case("minimax_m2", "plain", "thinking </thi", "thinking </thi", ""), sizes=[9])
def test_well_formed_replies_read_as_drawn(case: Case, sizes: list[int]) -> None:
    """The model reads the drawn thinking and content (no marker leaks into either), and the parser, whole and in
    any pieces, reads what the model reads."""
    assert reference(case.name, case.reply, case.mode) == (case.reasoning, case.content), case
    check_all(case.name, case.reply, case.mode, sizes)


@settings(max_examples=700, deadline=None, **PHASES)
@given(drawn=any_reply(), sizes=sizes_)
# Magistral: a first [/THINK] that nothing opened is dropped (vLLM's case 3.a), a second one kept (in its own piece)
@example(drawn=("mistral", "plain", "a[/THINK]b[/THINK]c"), sizes=[9])
# ... and one before a [THINK] too (vLLM's whole-reply parse keeps it there: the documented difference)
@example(drawn=("mistral", "plain", "x[/THINK]a[THINK]b[/THINK]c"), sizes=[2])
# Qwen3.5 calls a tool inside its thinking: <tool_call><function= ends the reasoning; a mere <tool_call> does not
@example(drawn=("qwen3", "plain", "a <tool_call> b <tool_call>\n<function=f>x</think>y"), sizes=[3])
@example(drawn=("qwen3", "plain", "a<tool_call>  <function\n"), sizes=[1])
@example(drawn=("qwen3", "plain", "a<tool_call><tool_call><function=f>"), sizes=[4])  # the second one opens it
# Hunyuan: the bare end marker ends the thought only right after the start marker
@example(drawn=("hunyuan_a13b", "plain", "<think>\nx</think>\n<answer>\nX"), sizes=[2])
# cut inside \n</answer>: held back, then content at the end
@example(drawn=("hunyuan_a13b", "plain", "<think>\nx\n</think>\n<answer>\nhalf\n</ans"), sizes=[1])
# Hunyuan with the thinking opened by the prompt
@example(drawn=("hunyuan_a13b", "opened", "</think>\n<answer>\nX"), sizes=[4])
# a start marker after other text: not an opener (glm45: all content; deepseek_r1: reasoning as written)
@example(drawn=("glm45", "plain", "a<think>b</think>c"), sizes=[1])
@example(drawn=("deepseek_r1", "plain", "a<think>b</think>c"), sizes=[1])
# whitespace then a start marker's first characters: held until they decide
@example(drawn=("glm45", "plain", "\n\u00a0<thi"), sizes=[1])
def test_any_reply_cut_anywhere_reads_as_the_model(drawn: tuple[str, str, str], sizes: list[int]) -> None:
    """Any reply of the parser's markers, their pieces and text, cut anywhere: whole and in any pieces, the model's
    reading, only a possible marker's start held back."""
    name, mode, reply = drawn
    check_all(name, reply, mode, sizes)


# ----------------------------------------------------------------------------------------------------------------
# Chained with a tool-call parser, as the server chains them (`ChatReply`: the reasoning stream's content is what
# the tool parser reads).

CALLS = {
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"x\": 1}\n```"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "mistral": '[TOOL_CALLS]f[ARGS]{"x": 1}',
    "glm45": "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="f">\n<parameter name="x">1</parameter>\n</invoke>\n'
                  "</minimax:tool_call>",
    "seed_oss": "<seed:tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</seed:tool_call>",
    "hunyuan_a13b": '<tool_calls>[{"name": "f", "arguments": {"x": 1}}]</tool_calls>',
    "qwen3_coder": "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
}
"""One call of ``f(x=1)`` in each tool-call parser's format (docs/integrations/openai-server.md's table)."""
PAIRS = [("qwen3", "hermes"), ("qwen3", "qwen3_coder"), ("deepseek_r1", "deepseek_v3"), ("mistral", "mistral"),
         ("glm45", "glm45"), ("minimax_m2", "minimax_m2"), ("seed_oss", "seed_oss"),
         ("hunyuan_a13b", "hunyuan_a13b")]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}]
SAFE = ["", "Let me think. ", "x < y ", "é 😀 ", "[1] ", "\n"]
"""Thinking and content text that no tool-call parser reads as its own."""


@dataclass(frozen=True)
class Chained:
    """A drawn reply for a (reasoning, tool-call) parser pair: a call inside the thinking and / or after it."""

    pair: tuple[str, str]
    mode: str
    reply: str
    inside: bool
    after: bool


@st.composite
def chained(draw: st.DrawFn) -> Chained:
    pair, mode = draw(st.sampled_from(PAIRS)), draw(st.sampled_from(["plain", "opened"]))
    f, call = FORMATS[pair[0]], CALLS[pair[1]]
    writes_start = not (f.by_template or mode == "opened") or draw(st.booleans())
    inside, after = draw(st.booleans()), draw(st.booleans())
    thinking = draw(st.sampled_from(SAFE)) + (call if inside else "") + draw(st.sampled_from(SAFE))
    answer = draw(st.sampled_from(["", "Sure. ", "\n\n", "a < b; é 😀 "])) + (call if after else "")
    tail = f.answer_end + "bye" if f.answer_end and draw(st.booleans()) else ""
    reply = (f.start if writes_start else "") + thinking + f.end + answer + tail
    return Chained(pair, mode, reply, inside, after)


def chat_message(case: Chained, pieces: list[str], streamed: bool) -> tuple[dict, str | None]:
    """The message `ChatReply` makes of the reply's pieces (ids left out: fresh per reply)."""
    reasoning, tools = case.pair
    mode = tool_mode(TOOLS, "auto", None, get_tool_parser(tools))
    reply = ChatReply(mode, get_reasoning_parser(reasoning), stream_arguments=streamed,
                      prompt_opened_thinking=case.mode == "opened")
    deltas = [d for piece in pieces for d in reply.feed(piece)]
    more, finish = reply.finish("stop")
    message = merge_deltas(deltas + more, tools=True, reasoning_parser=True)
    for call in message.get("tool_calls", ()):
        assert call.pop("id")
    return message, finish


@settings(max_examples=150, deadline=None, **PHASES)
@given(case=chained(), sizes=sizes_)
# Qwen3.5 calls from inside its thinking: the call ends the reasoning and is found (qwen3_coder's format) ...
@example(case=Chained(("qwen3", "qwen3_coder"), "plain", "Plan. " + CALLS["qwen3_coder"] + "</think>Ok.", True,
                      False), sizes=[3])
# ... a hermes call there is not <function: it stays reasoning, the call after </think> is found
@example(case=Chained(("qwen3", "hermes"), "plain", "Plan " + CALLS["hermes"] + "</think>\n\n" + CALLS["hermes"],
                      True, True), sizes=[5])
# Magistral's [TOOL_CALLS] begins as [THINK] does; a call in the thinking is reasoning
@example(case=Chained(("mistral", "mistral"), "plain", "[THINK]" + CALLS["mistral"] + "[/THINK]" + CALLS["mistral"],
                      True, True), sizes=[1])
# Hunyuan: the call is the answer's, before \n</answer>
@example(case=Chained(("hunyuan_a13b", "hunyuan_a13b"), "plain", "<think>\nx\n</think>\n<answer>\n"
                      + CALLS["hunyuan_a13b"] + "\n</answer>bye", False, True), sizes=[2])
def test_a_call_after_the_thinking_is_found_one_inside_it_is_not(case: Chained, sizes: list[int]) -> None:
    """Chained as the server chains them: the reasoning is the model's; the calls are the model's content's (the
    one after the thinking; the one inside only where it ends the thinking: qwen3's ``<tool_call><function=``), the
    content the model's less the calls; whole and streamed alike, finish_reason ``tool_calls`` with calls."""
    reasoning, content = reference(case.pair[0], case.reply, case.mode)
    call = CALLS[case.pair[1]]
    assert content.count(call) == case.after + (case.inside and case.pair == ("qwen3", "qwen3_coder"))
    assert (call in reasoning) == (case.inside and case.pair != ("qwen3", "qwen3_coder"))
    expected = {"role": "assistant", "content": content.replace(call, "") or None}
    if reasoning:
        expected["reasoning"] = reasoning
    if content.count(call):
        expected["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}] \
            * content.count(call)
    finish = "tool_calls" if content.count(call) else "stop"
    assert chat_message(case, [case.reply], streamed=False) == (expected, finish)
    assert chat_message(case, pieces_of(case.reply, sizes), streamed=True) == (expected, finish)


# ----------------------------------------------------------------------------------------------------------------
# What else the docstrings promise.


@pytest.mark.parametrize("name", NAMES)
def test_parser_attributes_as_documented(name: str) -> None:
    """Markers and flags as the docstrings give them: the template opens deepseek_r1's, qwen3's, minimax_m2's and
    seed_oss's thinking; mistral and glm45 think only when the reply's first token (glm45: after whitespace) opens
    it; mistral's markers are special tokens; the opener is the start marker; only qwen3 has a thinking switch
    (``enable_thinking`` false turns the thinking off)."""
    parser, f = get_reasoning_parser(name), FORMATS[name]
    hunyuan_end = f.end[1:] if f.answer_end else f.end  # the constraint starts after </think>\n<answer>\n
    assert (parser.start_tag, parser.end_tag, parser.opener) == (f.start, hunyuan_end, f.start)
    assert parser.opened_by_prompt == f.by_template
    assert parser.opened_first == (name in ("mistral", "glm45"))
    assert parser.opened_after_space == (name == "glm45")
    assert parser.needs_special_tokens == (name == "mistral")
    assert parser.forced_tool_calls and parser.prompt_ends_thinking and parser.end_suffix is None
    assert parser.thinking_off({"enable_thinking": False}) == (name == "qwen3")
    assert not parser.thinking_off({"enable_thinking": True}) and not parser.thinking_off({})
    assert type(parser) is REASONING_PARSERS[name]


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="deepseek_r1.*seed_oss"):
        get_reasoning_parser("deepseek")
