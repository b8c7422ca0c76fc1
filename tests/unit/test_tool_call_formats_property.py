"""The tool-call formats with their own markers (asyncllm/tool_call_blocks.py, asyncllm/tool_call_xml.py) against a
naive reading of their docs, whole and fed in any pieces.

Formats: ``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``, ``glm45``, ``minimax_m2``, ``hunyuan_a13b``, ``jamba``
(blocks read whole at their end tag), ``qwen3_coder`` (and its other name ``qwen3_xml``) and ``seed_oss`` (XML
functions and parameters typed by the tools' JSON schemas). test_parser_streams_property.py draws none of their
markers; ``granite`` and ``phi4_mini_json`` (own markers too) are only checked streamed against whole here.

Drawn: replies of free text (``<``, ``|``, ``{``, the formats' markers' pieces, DeepSeek's full-width ``｜`` and
``▁``, unicode), well-formed calls (drawn names; JSON arguments written with drawn separators, indents and escapes;
for the typed formats parameters of drawn JSON-schema types, values that fit them and values that do not), several
calls a block (where the format has it), groups of calls inside section markers, malformed blocks (no name, broken
JSON, no separator, text before a function, unterminated), and any reply cut anywhere (max_tokens).

The model (`reference`, tests/tool_call_formats_model.py) reads by the modules' docstrings and
docs/integrations/openai-server.md.

Checked: ``parse`` gives the model's content (stripped when there are calls, None when empty) and calls; a stream
fed the reply in drawn pieces (1-9 characters: markers cut anywhere), whole calls or streamed arguments, gives after
every piece exactly the model's reading of the text so far, less what the docs let it hold (the longest end of the
text that may start the opening tag or a section marker, an unfinished block, whitespace after a call), and at the
end the whole reply's; the XML formats' streamed pieces: the first (id, name) once ``<function=NAME>`` is read, each
parameter once its end tag is, joined the whole call's arguments; ``parallel_tool_calls: false`` keeps the first
call only; well-formed replies' content and arguments hold no marker, and the model reads the drawn calls.

Not drawn: a parameter key repeated in one call, non-ASCII parameter keys' escapes aside (see the XML example),
JSON NaN/Infinity. Set ``TOOL_FORMATS_PROPERTY_NO_SHRINK=1`` to skip shrinking (the mutation runs).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from asyncllm.integrations.openai_reply import ChatReply, merge_deltas
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.tool_calls import TOOL_PARSERS, ToolCallDelta, get_tool_parser
from test_harmony_property import pieces_of
from tool_call_formats_model import (DS_BEGIN, DS_CALL, DS_CALL_END, DS_END, DS_SEP, FORMATS, FUNCTIONS, JSON_SPACE,
                                     KIMI_ARGS, KIMI_BEGIN, KIMI_CALL, KIMI_CALL_END, KIMI_END, NAMES, SCHEMA_TYPES,
                                     TOOLS, Format, Reading, dumped, reference, schema_type, typed)

PHASES = {"phases": [Phase.explicit, Phase.reuse, Phase.generate]} if os.environ.get(
    "TOOL_FORMATS_PROPERTY_NO_SHRINK") else {}


def check_runs(runs: list[str], expected: list[str]) -> None:
    """The stream's content runs are exactly the model's (after a call, whitespace that came in a part of its own is
    held until content follows it, tool_call_streams.py's `TaggedBlockStream._spacing`; until 2026-12-07 whitespace
    after that content, come alone, was dropped too)."""
    runs = runs + [""] * (len(expected) - len(runs))
    expected = expected + [""] * (len(runs) - len(expected))
    assert runs[0] == expected[0], (runs, expected)
    assert runs[1:] == expected[1:], (runs, expected)


# ----------------------------------------------------------------------------------------------------------------
# The parsers, driven.


def parser_for(name: str):
    return get_tool_parser(name).for_tools(FUNCTIONS)


@dataclass
class Calls:
    """What a stream's call pieces said, by index: first piece (name, id), arguments joined, done."""

    names: dict[int, str] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)
    arguments: dict[int, str] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def add(self, d: ToolCallDelta) -> None:
        if d.name is not None:
            assert d.index not in self.names and d.id, d  # one first piece per call, with its id
            self.names[d.index], self.ids[d.index] = d.name, d.id
        assert d.index in self.names and d.index not in self.done, d  # no piece before the first, nor after done
        self.arguments[d.index] = self.arguments.get(d.index, "") + d.arguments
        if d.done:
            self.done.add(d.index)

    def whole(self) -> list[tuple[int, str, str]]:
        return [(i, self.names[i], self.arguments[i]) for i in sorted(self.done)]


def check_ids(fmt: Format, calls: Calls, expected: list[tuple[int, str, str, str | None]]) -> None:
    """``kimi_k2``'s id is its ``functions.NAME:N``; the others' fresh ``call_`` ids, all different."""
    for index, _, _, call_id in expected:
        if call_id is not None:
            assert calls.ids[index] == call_id
        else:
            assert re.fullmatch(r"call_[0-9a-f]{24}", calls.ids[index]), calls.ids[index]
    fresh = [i for i in calls.ids.values() if i.startswith("call_")]
    assert len(set(fresh)) == len(fresh)


def check_stream(fmt: Format, pieces: list[str], streamed: bool) -> str:
    """A delta stream fed `pieces`: after every piece the model's reading of the text so far, at the end the
    whole reply's; its content returned."""
    stream, runs, calls, seen = parser_for(fmt.name).delta_stream(streamed), [""], Calls(), ""
    for piece in [*pieces, None]:
        out = stream.feed(piece) if piece is not None else stream.finish()
        seen += piece or ""
        for part in out:
            if isinstance(part, str):
                runs[-1] += part
                continue
            if part.name is not None:
                runs.append("")
            calls.add(part)
        so_far = reference(fmt, seen, whole=piece is None)
        check_runs(runs, so_far.runs)
        assert calls.whole() == [c[:3] for c in so_far.calls], seen
        if streamed and fmt.xml:
            assert {i: (calls.names[i], calls.arguments[i]) for i in calls.names} == so_far.started, seen
    assert sorted(calls.names) == sorted(calls.done)  # no call started and left unfinished
    check_ids(fmt, calls, so_far.calls)
    return "".join(runs)


def check_parse(fmt: Format, reply: str, expected: Reading, content: str) -> None:
    """``parse``: the model's calls; its content the whole reply's stream's (stripped with calls, None when
    empty)."""
    parsed = parser_for(fmt.name).parse(reply)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(n, a) for _, n, a, _ in expected.calls]
    assert parsed.content == ((content.strip() if expected.calls else content) or None)
    for index, call in enumerate(parsed.tool_calls):
        assert call.id == expected.calls[index][3] or expected.calls[index][3] is None


def check_whole_stream(fmt: Format, pieces: list[str], expected: Reading, content: str) -> None:
    """`ToolParser.stream` (whole calls) over the pieces: the delta stream's content, the model's calls."""
    stream, got, calls = parser_for(fmt.name).stream(), "", []
    for piece in pieces:
        text, new = stream.feed(piece)
        got, calls = got + text, calls + new
    text, new = stream.finish()
    assert (got + text, [(c.name, c.arguments) for c in calls + new]) == (
        content, [(n, a) for _, n, a, _ in expected.calls])


def check_not_parallel(fmt: Format, pieces: list[str], expected: Reading, content: str) -> None:
    """``parallel_tool_calls: false`` (`ChatReply`, streamed and whole): the first call only, the same content."""
    for streamed in (True, False):
        reply = ChatReply(tool_mode(TOOLS, "auto", False, get_tool_parser(fmt.name)), stream_arguments=streamed)
        deltas = [d for piece in pieces for d in reply.feed(piece)]
        more, finish = reply.finish("stop")
        message = merge_deltas(deltas + more, tools=True)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert calls == [(n, a) for _, n, a, _ in expected.calls[:1]]
        assert message["content"] == (content or None)
        assert finish == ("tool_calls" if expected.calls else "stop")


def check_all(fmt: Format, reply: str, sizes: list[int]) -> Reading:
    """Every check, on the reply whole and fed in the drawn pieces (and one character at a time)."""
    expected = reference(fmt, reply)
    for pieces in ([reply], pieces_of(reply, sizes)):
        content = check_stream(fmt, pieces, streamed=False)
        assert check_stream(fmt, pieces, streamed=True) == content
        if len(pieces) == 1:
            check_parse(fmt, reply, expected, content)
        check_whole_stream(fmt, pieces, expected, content)
    check_not_parallel(fmt, pieces, expected, content)
    return expected


# ----------------------------------------------------------------------------------------------------------------
# Drawn replies.

TEXT = ["a", "Paris", "2+2 is 4.", " ", "\n", "<", "|", ">", "{", "}", '"', "é", "Ω", "😀", "\t", "｜", "▁", "<｜",
        "<｜tool▁call", "<｜tool▁calls▁", "▁begin｜>", "<|tool_call", "<|tool_calls_section", "_end|>", "<tool",
        "</tool_call", "<tool_call", "<minimax:", "<seed:tool", "<function=", "<parameter=", "</parameter>",
        "```", "functions.f:0", "[", "]"]
"""Free text: markers' pieces, never a whole tag or marker (`no_tag` drops texts whose pieces join into one)."""
ALL_TAGS = tuple({t for f in FORMATS.values() for t in (f.open, f.close, *f.markers)})


def no_tag(fmt: Format, text: str) -> bool:
    return not any(tag in text for tag in (fmt.open, fmt.close, *fmt.markers, DS_SEP, KIMI_ARGS))


safe_strings = st.lists(st.characters(blacklist_categories=("Cs",)) | st.sampled_from(["<", "|", "｜", "▁", "\\", '"',
                                                                                       "é", "😀", "```"]),
                        max_size=5).map("".join).filter(lambda s: not any(t in s for t in ALL_TAGS))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20) | st.floats(allow_nan=False, allow_infinity=False)
    | safe_strings, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(safe_strings, inner, max_size=3),
    max_leaves=6)


@st.composite
def json_text(draw: st.DrawFn, value: object) -> str:
    """`value` as a model may write it: drawn separators, indent and escapes."""
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" , ", " : ")]))
    return json.dumps(value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 0, 2])),
                      separators=separators)


@st.composite
def json_objects(draw: st.DrawFn) -> str:
    """A JSON object's text as written, maybe with JSON whitespace around."""
    space = st.text(st.sampled_from(JSON_SPACE), max_size=2)
    return draw(space) + draw(json_text(draw(st.dictionaries(safe_strings, json_values, max_size=4)))) + draw(space)


VALUES = {"string": ["Paris", "a b", "é 😀", "1", "true", "null", "", "{", "x\ny", "\nlead", "trail\n", "<", "a|b"],
          "integer": ["3", "-7", "007", "1.5", "x", "1e3", "NULL"],
          "number": ["2.0", "1e3", "2.5", "-0.0", "nan", "1e999", "x", "3", "-1.25E-2"],
          "boolean": ["true", "TRUE", "false", "yes", "1", "True"],
          "object": ['{"a": 1}', "{'a': 1}", "{1, 2}", "[1]", "x", '{"a": [1, {"b": null}]}', "1j", "{", "NaN"],
          "array": ["[1, 2]", "(1, 2)", "[", "[1, 'a']", "NaN", "[true, null]", "{}"]}
"""Parameter texts by schema type: ones that fit it and ones that do not."""


@st.composite
def parameters(draw: st.DrawFn) -> list[tuple[str, str]]:
    """Distinct keys of drawn types, each with a drawn value text."""
    keys = draw(st.lists(st.sampled_from(sorted(SCHEMA_TYPES)), unique=True, max_size=4))
    return [(key, draw(st.sampled_from(VALUES[schema_type(key) if schema_type(key) in VALUES else "string"]
                                       + VALUES["string"][:3]))) for key in keys]


def typed_arguments(function: str, params: list[tuple[str, str]], strip: bool = False) -> str:
    return dumped({key: typed(value.strip() if strip else value, schema_type(key, function)) for key, value in params})


@st.composite
def calls(draw: st.DrawFn, fmt: Format) -> tuple[str, list[tuple[str, str, str | None]]]:
    """One block of well-formed calls in `fmt` (several where the format has them): its text and its calls
    (name, arguments, id), as the drawn parts say they are."""
    name = draw(st.sampled_from(NAMES))
    space = draw(st.sampled_from(["", "\n", " "]))
    if fmt.name == "deepseek_v3":
        arguments = draw(json_objects())
        fence = draw(st.sampled_from(["```json", "```"]))
        prefix = draw(st.sampled_from(["function", ""]))
        return (f"{fmt.open}{prefix}{DS_SEP}{name}\n{fence}\n{arguments}\n```{space}{fmt.close}",
                [(name, arguments, None)])
    if fmt.name == "deepseek_v31":
        arguments = draw(json_objects())
        return f"{fmt.open}{name}{DS_SEP}{arguments}{fmt.close}", [(name, arguments, None)]
    if fmt.name == "kimi_k2":
        arguments, number = draw(json_objects()), draw(st.integers(0, 12))
        call_id = f"functions.{name}:{number}"
        return f"{fmt.open}{space}{call_id}{space}{KIMI_ARGS}{arguments}{fmt.close}", [
            (name, arguments.strip(JSON_SPACE), call_id)]
    if fmt.name == "glm45":
        params = draw(parameters())
        pairs = "".join(f"<arg_key>{k}</arg_key>{space}<arg_value>{v}</arg_value>\n" for k, v in params)
        return f"{fmt.open}{name}\n{pairs}{fmt.close}", [(name, typed_arguments(name, params, strip=True), None)]
    if fmt.name in ("hunyuan_a13b", "jamba"):
        drawn = draw(st.lists(st.tuples(st.sampled_from(NAMES), st.none() | st.dictionaries(
            safe_strings, json_values, max_size=3)), min_size=1, max_size=3))
        values = [{"name": n} if a is None else {"name": n, "arguments": a} for n, a in drawn]
        return f"{fmt.open}{draw(json_text(values))}{fmt.close}", [(n, dumped(a or {}), None) for n, a in drawn]
    invocations = draw(st.lists(st.tuples(st.sampled_from(NAMES), parameters()), min_size=1, max_size=3))
    if fmt.name == "minimax_m2":
        newline = draw(st.sampled_from(["", "\n"]))
        text = "".join(f'<invoke name="{n}">{space}' + "".join(
            f'<parameter name="{k}">{newline}{v}{newline}</parameter>{space}' for k, v in params) + "</invoke>\n"
            for n, params in invocations)
        read = [(n, [(k, (newline + v + newline).removeprefix("\n").removesuffix("\n")) for k, v in params])
                for n, params in invocations]
        return f"{fmt.open}\n{text}{fmt.close}", [(n, typed_arguments(n, params), None) for n, params in read]
    text = "".join(f"<function={n}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
                   + f"</function>{space}" for n, params in invocations)
    return f"{fmt.open}\n{text}{fmt.close}", [(n, typed_arguments(n, params), None) for n, params in invocations]


BROKEN = {
    "deepseek_v3": [f"function{DS_SEP}f\n```json\n{{oops\n```", f"function{DS_SEP}f\n{{}}",
                    "function f\n```json\n{}\n```", f"function{DS_SEP}f\n```json\n[1]\n```",
                    f"{DS_SEP}\n```json\n{{}}\n```"],
    "deepseek_v31": ["f{}", f"{DS_SEP}{{}}", f"f{DS_SEP}{{", f"f{DS_SEP}[1]", f" {DS_SEP}{{}}", f"f{DS_SEP}{{}} x"],
    "kimi_k2": [f"f{KIMI_ARGS}{{}}", f"functions.f{KIMI_ARGS}{{}}", f"functions.f:x{KIMI_ARGS}{{}}",
                "functions.f:0{}", f"functions.f:0{KIMI_ARGS}{{", f"functions.:0{KIMI_ARGS}{{}}"],
    "glm45": ["f\n<arg_key>a</arg_key>\n", "", "\n<arg_key>a</arg_key><arg_value>1</arg_value>", "f g\nh",
              "<x>", "f\n<arg_key>a</arg_key><arg_value>1</arg_value>junk"],
    "minimax_m2": ['<invoke name="f"><parameter name="a">1</invoke>', "", 'x<invoke name="f"></invoke>',
                   '<invoke name="">\n</invoke>', '<invoke name="f">junk</invoke>', '<invoke name="f"></invoke> x'],
    "hunyuan_a13b": ['[{"name": "f", "arguments": [1]}]', "not json", "[]", '[{"arguments": {}}]', '{"name": "f"}',
                     '[{"name": 1}]', "[1]"],
    "jamba": ['[{"name": "f", "arguments": "{}"}]', "[", '[{"name": "f"}] x'],
    "qwen3_coder": ["\n1\n<function=f>\n</function>\n", "\n", "<function=\n>", "x<function=f>", "<parameter=a>1"],
    "seed_oss": ["\nx\n<function=f>\n</function>\n", "", "<function=>", "<Function=f>"],
}
"""Block bodies that are no call (the formats' own malformed writing: no name, broken JSON, no separator...)."""
BROKEN["jamba"] += BROKEN["hunyuan_a13b"]
OPEN_XML = ["<function=f>\n<parameter=n>\n4\n<parameter=city>\nParis\n</function>", "<function=f>\n<parameter=a>\n1\n",
            "<function=f>\n<parameter=x>\n2.0\n</parameter>\nnot read\n</function>\nnor this\n<function=g>",
            "\n<function=add>\n<parameter=obj>\n{'a': 1}\n\n</function>", "<function=f>\n<parameter=s>\nx\n\n\n"]
"""XML block bodies as vLLM's regexes read them: parameters or functions left open, text between not read."""


@st.composite
def segments(draw: st.DrawFn, fmt: Format, well_formed: bool) -> list[tuple[str, list]]:
    """A reply's parts: free text, groups of call blocks (inside the section markers where the format has them),
    and (not `well_formed`) broken blocks, stray tags and markers, XML blocks with open parts."""
    text = st.lists(st.sampled_from(TEXT), max_size=5).map("".join)
    if well_formed:
        text = text.filter(lambda t: no_tag(fmt, t))
    group = st.builds(lambda g, gap: grouped(fmt, g, gap), st.lists(calls(fmt), min_size=1, max_size=3),
                      st.sampled_from(["", "\n"]))
    parts = [text.map(lambda t: (t, [])), group]
    if not well_formed:
        junk = [fmt.open, fmt.close, *fmt.markers, fmt.open + fmt.close, "\n"]
        parts += [st.sampled_from(BROKEN[fmt.name]).map(lambda b: (fmt.open + b + fmt.close, [])),
                  st.sampled_from(junk).map(lambda j: (j, []))]
        if fmt.xml:
            parts.append(st.sampled_from(OPEN_XML).map(lambda b: (fmt.open + b, [])))
    drawn = st.lists(st.one_of(parts), max_size=5)
    if well_formed:  # free texts side by side read as one, and the content joins them all: no tag there either
        drawn = drawn.filter(lambda ps: all(no_tag(fmt, run) for run in [*text_runs(ps), content_of(ps)]))
    return draw(drawn)


def text_runs(parts: list[tuple[str, list]]) -> list[str]:
    """The texts of consecutive free-text parts (no calls), joined."""
    runs, run = [], ""
    for text, calls_ in parts:
        if calls_:
            runs, run = runs + [run], ""
        else:
            run += text
    return runs + [run]


def content_of(parts: list[tuple[str, list]]) -> str:
    """Every free-text part joined: the reply's content once its call groups are taken out."""
    return "".join(text for text, calls_ in parts if not calls_)


def grouped(fmt: Format, group: list[tuple[str, list]], gap: str) -> tuple[str, list]:
    begin, end = fmt.markers or ("", "")
    return (begin + gap.join(text for text, _ in group) + end, [c for _, cs in group for c in cs])


def rendered(parts: list[tuple[str, list]]) -> tuple[str, list]:
    return "".join(t for t, _ in parts), [c for _, cs in parts for c in cs]


sizes_ = st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=12)
format_names = st.sampled_from(sorted(FORMATS))


@st.composite
def well_formed_replies(draw: st.DrawFn) -> tuple[str, str]:
    name = draw(format_names)
    return name, draw(segments(FORMATS[name], well_formed=True).map(lambda p: rendered(p)[0]))


# ----------------------------------------------------------------------------------------------------------------
# The properties.

DS31 = f"{DS_BEGIN}{DS_CALL}add{DS_SEP}" + '{"a" : 1,"b":"\\u00e9"}' + f"{DS_CALL_END}{DS_END}"


@settings(max_examples=160, deadline=None, **PHASES)
@given(name=format_names, data=st.data(), sizes=sizes_)
def test_well_formed_replies_read_as_drawn(name: str, data: st.DataObject, sizes: list[int]) -> None:
    """A reply of free text and well-formed calls: the model reads the drawn calls, in order, with no tag or marker
    in the content nor in any arguments; the parsers read what the model reads, whole and in any pieces."""
    fmt = FORMATS[name]
    reply, drawn = rendered(data.draw(segments(fmt, well_formed=True)))
    expected = reference(fmt, reply)
    assert [(n, a, i) for _, n, a, i in expected.calls] == drawn
    tags = (fmt.open, fmt.close, *fmt.markers)
    assert not any(tag in expected.content for tag in tags)
    assert not any(tag in a for _, _, a, _ in expected.calls for tag in tags)
    check_all(fmt, reply, sizes)


@settings(max_examples=450, deadline=None, **PHASES)
@given(name=format_names, data=st.data(), cut=st.none() | st.integers(min_value=0), sizes=sizes_, reply=st.none())
# section markers, calls and content around them, cut inside the markers
@example(name="deepseek_v31", data=None, cut=None, sizes=[5, 3],
         reply="Checking.\n" + DS31 + "\nDone.")
# a possible marker's start is held only while it may be one: "<｜tool▁calls" then "<" can start no marker
@example(name="deepseek_v31", data=None, cut=None, sizes=[13, 1, 5], reply="<｜tool▁calls<x")
# "<" then a whole marker in one piece: the "<" is text at once (a marker's start is read before the markers go)
@example(name="deepseek_v3", data=None, cut=None, sizes=[99], reply="<<｜tool▁calls▁begin｜>")
# kimi's id is its functions.NAME:N; the arguments less the spaces around
@example(name="kimi_k2", data=None, cut=None, sizes=[2], reply=KIMI_BEGIN + KIMI_CALL + " functions.add:3 " + KIMI_ARGS
         + ' {"a":1} ' + KIMI_CALL_END + KIMI_END)
# qwen3_coder: several functions in a block, an open parameter and function, the block cut by the reply's end
@example(name="qwen3_coder", data=None, cut=None, sizes=[1],
         reply="x <tool_call>\n<function=add>\n<parameter=n>\n1\n<parameter=arr>\n[2]\n</function>\n<function=f>\n"
         "<parameter=flag>\nTRUE\n</parameter>\n<parameter=city>\nParis\n\n")
# seed_oss: a parameter without </parameter> runs to the function's end, <parameter= included
@example(name="seed_oss", data=None, cut=None, sizes=[4],
         reply="<seed:tool_call>\n<function=f>\n<parameter=n>\n1\n<parameter=city>\nP\n</function>\n</seed:tool_call>")
# a non-ASCII parameter name is written as json.dumps(..., ensure_ascii=False) writes the arguments
@example(name="qwen3_coder", data=None, cut=None, sizes=[3],
         reply="<tool_call>\n<function=f>\n<parameter=café>\n1\n</parameter>\n</function>\n</tool_call>")
# glm45: values stripped and typed; whitespace between calls is no content
@example(name="glm45", data=None, cut=None, sizes=[7],
         reply="<tool_call>add\n<arg_key>n</arg_key>\n<arg_value> 7 </arg_value>\n</tool_call>\n \n<tool_call>f\n"
         "</tool_call> then")
# a broken block between calls is content; a block the reply's end cut off is content
@example(name="minimax_m2", data=None, cut=None, sizes=[6],
         reply='<minimax:tool_call><invoke name="f"></invoke></minimax:tool_call>x<minimax:tool_call>junk'
         '</minimax:tool_call><minimax:tool_call><invoke name="add"><parameter name="n">\n2\n</parameter>')
def test_any_reply_cut_anywhere_reads_as_the_model(name: str, data: st.DataObject | None, cut: int | None,
                                                   sizes: list[int], reply: str | None) -> None:
    """Any reply (malformed ones; cut anywhere: max_tokens): the parsers, whole and in any pieces, read what the
    model reads."""
    fmt = FORMATS[name]
    if reply is None:
        assert data is not None
        reply = rendered(data.draw(segments(fmt, well_formed=False)))[0]
    if cut is not None:
        reply = reply[:cut % (len(reply) + 1)]
    check_all(fmt, reply, sizes)


def test_block_parsers_keep_special_tokens_and_aliases() -> None:
    """The block formats' markers are special tokens (kept in the text they read); ``qwen3_xml`` is ``qwen3_coder``."""
    assert all(get_tool_parser(name).needs_special_tokens for name in FORMATS if name != "qwen3_coder")
    assert type(get_tool_parser("qwen3_xml")) is type(get_tool_parser("qwen3_coder"))


GRANITE_PHI = ["<|tool_call|>", "<tool_call>", "functools", '[{"name": "f", "arguments": {"x": 1}}]', "[", "]",
               '{"name": "g"}', ", ", " ", "\n", "text", "<|tool", "func", "<", "|", "Ω", "{"]


@settings(max_examples=80, deadline=None, **PHASES)
@given(name=st.sampled_from(["granite", "phi4_mini_json"]), reply=st.lists(st.sampled_from(GRANITE_PHI),
                                                                            max_size=8).map("".join), sizes=sizes_)
def test_granite_and_phi4_stream_as_whole(name: str, reply: str, sizes: list[int]) -> None:
    """``granite`` and ``phi4_mini_json`` (markers of their own, no model here): fed in any pieces, the stream's
    content and calls are the whole reply's."""
    assert name in TOOL_PARSERS
    stream, content, found = get_tool_parser(name).stream(), "", []
    for piece in [*pieces_of(reply, sizes), None]:
        text, new = stream.feed(piece) if piece is not None else stream.finish()
        content, found = content + text, found + new
    whole = get_tool_parser(name).parse(reply)
    assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert ((content.strip() if found else content) or None) == whole.content
