"""The JSON-style tool-call formats (``llama3_json`` / ``llama4_json``, ``pythonic`` / ``llama4_pythonic``,
``mistral``, ``granite``, ``phi4_mini_json``) against a plain reading of their docs, whole and fed in any pieces.

The model (`read`) is written from asyncllm/tool_calls.py's, tool_call_llama3.py's and tool_call_replies.py's
docstrings and docs/integrations/openai-server.md's parser table, with Python's ``json`` as the JSON reader (as
vLLM's parsers use it):

- ``llama3_json``: every ``{`` is tried in order; a ``{`` that starts no JSON value (or whose value the reply's end
  cut off) is text and the next ``{`` is tried; a JSON object ``{"name": str, "arguments" | "parameters": {...} or
  null}`` is a call (null arguments: ``"null"``, as vLLM's json.dumps of them), any other object is text, braces
  inside it included. A reply with calls has no content (``parse``: None; `ToolParser.stream`, which holds a whole
  reply's text to its end: none); streamed arguments (``delta_stream(True)``): the text before the first call, as
  written (leading ``<|python_tag|>``s, ``;`` and whitespace alone before it are held and dropped: `held_lead`),
  nothing after it. A reply without calls is all content, as written.
- ``pythonic``: a reply that is ``[`` ... ``]`` (or inside ``<|python_start|>`` ... ``<|python_end|>``), a non-empty
  Python list of ``name(key=literal, ...)`` calls, is calls; any other reply is content, all of it.
- ``mistral``: content up to the first ``[TOOL_CALLS]``; after it, a JSON list of ``{"name", "arguments"}`` objects
  (what follows the list ignored) or ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (whitespace only after the
  last). If the part after ``[TOOL_CALLS]`` is not all calls, the whole reply is content.
- ``granite``: a reply starting with ``<|tool_call|>`` or ``<tool_call>`` and then a JSON list of calls (nothing
  else after it) is calls, with no content; any other reply (Mistral's ``name[ARGS]{...}`` after the opener
  included) is content.
- ``phi4_mini_json``: content up to the first ``functools``, then a JSON list of calls (text after it dropped;
  ``name[ARGS]{...}`` after it is no call).

Checked: ``parse`` gives exactly the drawn calls (names; arguments ``json.dumps(..., ensure_ascii=False)`` of the
drawn object, so JSON-equal to it) and the documented content; `ToolParser.stream` and ``delta_stream(True)`` fed
the reply in drawn pieces (1-9 characters) give the same calls and content; text that is no call (malformed JSON,
a name-less object, prose with brackets and braces, the formats' markers in prose) is content and yields no call;
after every piece each stream has released exactly what the docs say it may no longer hold: ``llama3_json``'s
`stream` nothing (a whole reply's text waits for its end) and each call once its object closed, its streamed
content all but a possible ``<|python_tag|>`` start, an object still open that may yet be JSON (released at the
first character json.loads refuses), and leading separators; ``mistral`` / ``phi4_mini_json`` all content but a
possible opener's start, then nothing after the opener (calls are done only at the reply's end); ``granite`` /
``pythonic`` nothing while the reply may still open with their opener, then all of it as it comes (not calls) or
nothing (calls, read at the end).

Three differences from the docs it found are fixed (each has a plain test at the end): ``granite`` and
``phi4_mini_json`` read Mistral's ``name[ARGS]{...}``; ``llama3_json`` held an object ending in a number or literal
that was already no JSON (``{"a": 01``) until the next character; its docstring said streamed content drops a
leading ``<|python_tag|>`` that the code (rightly, as vLLM's content keeps it) sends. Not drawn: Mistral list
items without ``arguments`` (here ``{}``; vLLM's parser fails on them), a key repeated in a call object, objects
nested past the ``llama3_json`` retry bound, ``llama3_json`` objects with both ``arguments`` and ``parameters``.

Set ``TOOL_FORMATS_PROPERTY_NO_SHRINK=1`` to skip shrinking (mutation runs).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from asyncllm.tool_calls import TOOL_PARSERS, get_tool_parser
from test_harmony_property import pieces_of
from test_tool_call_formats_property import Calls

PHASES = {"phases": [Phase.explicit, Phase.reuse, Phase.generate]} if os.environ.get(
    "TOOL_FORMATS_PROPERTY_NO_SHRINK") else {}

EXAMPLES = int(os.environ.get("TOOL_FORMATS_PROPERTY_EXAMPLES", "80"))
PYTHON_TAG, PYTHON_START, PYTHON_END = "<|python_tag|>", "<|python_start|>", "<|python_end|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
GRANITE_OPENERS = ("<|tool_call|>", "<tool_call>")
FUNCTOOLS = "functools"
PYTHONIC_OPENERS = ("[", PYTHON_START)
JSON_SPACE = " \t\n\r"
SEPARATORS = JSON_SPACE + ";"
DECODER = json.JSONDecoder()

FORMATS = ["llama3_json", "llama4_json", "pythonic", "llama4_pythonic", "mistral", "granite", "phi4_mini_json"]
CANONICAL = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic"}


def canonical(name: str) -> str:
    return CANONICAL.get(name, name)


def dumped(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------------------------
# The model.


class _End(Exception):
    """The text ended where the JSON value may still go on."""


class _Bad(Exception):
    """A character no JSON value can have there."""


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_START = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.|\.[0-9]+(?:[eE][-+]?[0-9]*)?|[eE][-+]?[0-9]*)?)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")


def json_prefix(text: str) -> bool:
    """Whether `text` begins some JSON value as Python's ``json`` reads it (NaN and Infinity included)."""
    try:
        _value(text, 0)
    except _End:
        return True
    except _Bad:
        return False
    return True


def _space(text: str, i: int) -> int:
    while i < len(text) and text[i] in JSON_SPACE:
        i += 1
    if i == len(text):
        raise _End
    return i


def _value(text: str, i: int) -> int:
    i = _space(text, i)
    char = text[i]
    if char == "{":
        return _items(text, i + 1, "}", True)
    if char == "[":
        return _items(text, i + 1, "]", False)
    if char == '"':
        return _string(text, i)
    rest = text[i:]
    for literal in _LITERALS:
        if rest.startswith(literal):
            return i + len(literal)
        if literal.startswith(rest):
            raise _End
    run = re.match(r"[-+.0-9eE]*", rest).group()
    if i + len(run) == len(text) and run and _NUMBER_START.fullmatch(run):
        raise _End
    match = _NUMBER.match(rest)
    if match is None:
        raise _Bad
    return i + match.end()


def _items(text: str, i: int, close: str, key: bool) -> int:
    i = _space(text, i)
    if text[i] == close:
        return i + 1
    while True:
        if key:
            i = _space(text, i)
            if text[i] != '"':
                raise _Bad
            i = _space(text, _string(text, i))
            if text[i] != ":":
                raise _Bad
            i += 1
        i = _space(text, _value(text, i))
        if text[i] == close:
            return i + 1
        if text[i] != ",":
            raise _Bad
        i += 1


def _string(text: str, i: int) -> int:
    i += 1
    while True:
        if i >= len(text):
            raise _End
        char = text[i]
        if char == '"':
            return i + 1
        if ord(char) < 0x20:
            raise _Bad
        if char == "\\":
            if i + 1 >= len(text):
                raise _End
            escape = text[i + 1]
            if escape == "u":
                digits = text[i + 2:i + 6]
                if not all(c in "0123456789abcdefABCDEF" for c in digits):
                    raise _Bad
                if len(digits) < 4:
                    raise _End
                i += 6
                continue
            if escape not in '"\\/bfnrt':
                raise _Bad
            i += 2
            continue
        i += 1


def partial(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `tags`."""
    return max([n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])], default=0)


def held_lead(text: str) -> str:
    """Streamed ``llama3_json`` content before the first call: none while it is only ``<|python_tag|>``s, ``;`` and
    whitespace (held, dropped if a call follows), else all of it as written."""
    rest = text
    while True:
        stripped = rest.lstrip(SEPARATORS).removeprefix(PYTHON_TAG)
        if stripped == rest:
            return text if rest else ""
        rest = stripped


Call = tuple[str, str]
"""A call as the model reads it: name, arguments (json.dumps of the object, ensure_ascii=False)."""


def json_call(value: object, keys: tuple[str, ...]) -> Call | None:
    """``{"name": str, KEY: {...} or null}`` with the first of `keys` it has (one of them needed); None when it is
    not (null arguments: a call whose arguments are ``null``, as vLLM's json.dumps of them)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in keys if k in value), None)
    if key is None or not isinstance(value[key], (dict, type(None))):
        return None
    return value["name"], dumped(value[key])


def llama3_pieces(text: str, final: bool) -> tuple[list[str | Call], bool]:
    """The reply's text runs and calls in order, and whether an object is still open (not `final`: the text so far
    ends in an unfinished ``{`` that may still be JSON; what follows its ``{`` is not read yet)."""
    pieces: list[str | Call] = []
    pos = start = 0
    while (start := text.find("{", start)) >= 0:
        try:
            value, end = DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            if not final and json_prefix(text[start:]):
                pieces.append(text[pos:start])
                return pieces, True
            start += 1  # no JSON value (or cut off by the end): text, and the next "{" is tried
            continue
        call = json_call(value, ("arguments", "parameters"))
        if call is not None:
            pieces += [text[pos:start], call]
            pos = start = end
        else:
            start = end  # an object that is no call is text, braces inside it included
    pieces.append(text[pos:])
    return pieces, False


def json_list_calls(value: object) -> list[Call] | None:
    """A non-empty JSON list of ``{"name": str, "arguments": {...}}``."""
    if not isinstance(value, list) or not value:
        return None
    calls = [json_call(item, ("arguments",)) for item in value]
    return None if None in calls else calls  # type: ignore[return-value]


def listed_calls(rest: str, trailing: bool) -> list[Call] | None:
    """`rest` (after an opener): whitespace, then a JSON list of calls; `trailing`: text after it ignored (else
    whitespace only)."""
    rest = rest.lstrip()
    if not rest.startswith("["):
        return None
    try:
        value, end = DECODER.raw_decode(rest)
    except (ValueError, RecursionError):
        return None
    if not trailing and rest[end:].strip():
        return None
    return json_list_calls(value)


def mistral_calls(rest: str) -> list[Call] | None:
    """After the first ``[TOOL_CALLS]``: a JSON list (text after it ignored), or ``name[ARGS]{...}`` per
    ``[TOOL_CALLS]`` (JSON whitespace between, any whitespace after the last)."""
    if rest.lstrip().startswith("["):
        return listed_calls(rest, trailing=True)
    calls = []
    segments = rest.split(TOOL_CALLS)
    for n, segment in enumerate(segments):
        name, sep, body = segment.partition(ARGS)
        body = body.lstrip(JSON_SPACE)
        if not sep or not name.strip() or not body.startswith("{"):
            return None
        try:
            value, end = DECODER.raw_decode(body)
        except (ValueError, RecursionError):
            return None
        tail = body[end:]
        if (tail.strip() if n == len(segments) - 1 else tail.strip(JSON_SPACE)) or not isinstance(value, dict):
            return None
        calls.append((name.strip(), dumped(value)))
    return calls


@dataclass
class Reading:
    """The model's reading: the content a stream sends (`parse` strips it when there are calls) and the calls."""

    content: str
    calls: list[Call]


def read(name: str, text: str, streamed: bool = False) -> Reading:
    """The documented reading of a whole reply (`streamed`: the content ``delta_stream(True)`` sends); ``pythonic``
    replies are read by `pythonic_reading` (the caller's drawn calls), so here only as not calls."""
    name = canonical(name)
    if name == "llama3_json":
        pieces, _ = llama3_pieces(text, final=True)
        calls = [p for p in pieces if isinstance(p, tuple)]
        if not calls:
            return Reading(text, [])
        first = next(i for i, p in enumerate(pieces) if isinstance(p, tuple))
        before = "".join(p for p in pieces[:first] if isinstance(p, str))
        return Reading(held_lead(before) if streamed else "", calls)
    if name == "granite":
        head = text.lstrip()
        opener = next((o for o in GRANITE_OPENERS if head.startswith(o)), None)
        calls = listed_calls(head[len(opener):], trailing=False) if opener else None
        return Reading("", calls) if calls else Reading(text, [])
    if name in ("mistral", "phi4_mini_json"):
        opener = TOOL_CALLS if name == "mistral" else FUNCTOOLS
        start = text.find(opener)
        rest = text[start + len(opener):]
        calls = None if start < 0 else mistral_calls(rest) if name == "mistral" else listed_calls(rest, trailing=True)
        return Reading(text[:start], calls) if calls else Reading(text, [])
    assert name == "pythonic"
    return Reading(text, [])


def read_so_far(name: str, seen: str, streamed: bool) -> Reading:
    """What a stream fed `seen` (the reply still going on) must have released by now: content and whole calls."""
    name = canonical(name)
    if name == "llama3_json":
        pieces, open_object = llama3_pieces(seen, final=False)
        calls = [p for p in pieces if isinstance(p, tuple)]
        if not streamed:
            return Reading("", calls)  # a whole reply's text waits for its end
        first = next((i for i, p in enumerate(pieces) if isinstance(p, tuple)), len(pieces))
        before = "".join(p for p in pieces[:first] if isinstance(p, str))
        if not calls and not open_object:
            before = before[:len(before) - partial(before, (PYTHON_TAG,))]
        return Reading(held_lead(before), calls)
    if name in ("granite", "pythonic"):
        openers = GRANITE_OPENERS if name == "granite" else PYTHONIC_OPENERS
        head = seen.lstrip()
        undecided = not head or any(o.startswith(head) for o in openers) or head.startswith(openers)
        return Reading("" if undecided else seen, [])
    opener = TOOL_CALLS if name == "mistral" else FUNCTOOLS
    start = seen.find(opener)
    return Reading(seen[:start] if start >= 0 else seen[:len(seen) - partial(seen, (opener,))], [])


# ----------------------------------------------------------------------------------------------------------------
# The parsers, driven.


def named(calls: Calls) -> list[Call]:
    """A delta stream's whole calls in index order: (name, arguments)."""
    return [(name, arguments) for _, name, arguments in calls.whole()]


def check_ids(name: str, ids: list[str]) -> None:
    """``mistral``'s ids are 9 letters and digits (vLLM's ``MistralToolCall``); the others' ``call_`` and 24 hex
    digits; all different."""
    pattern = r"[A-Za-z0-9]{9}" if canonical(name) == "mistral" else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(pattern, i) for i in ids), ids
    assert len(set(ids)) == len(ids), ids


def check_delta_stream(name: str, pieces: list[str], reply: str) -> None:
    """``delta_stream(True)``: after every piece what `read_so_far` says, at the end the whole reply's reading; the
    arguments' pieces join to the call's arguments."""
    stream, content, calls, seen = get_tool_parser(name).delta_stream(True), "", Calls(), ""
    for piece in pieces:
        for part in stream.feed(piece):
            if isinstance(part, str):
                content += part
            else:
                calls.add(part)
        seen += piece
        expected = read_so_far(name, seen, streamed=True)
        assert (content, named(calls)) == (expected.content, expected.calls), seen
    for part in stream.finish():
        if isinstance(part, str):
            content += part
        else:
            calls.add(part)
    whole = read(name, reply, streamed=True) if canonical(name) != "pythonic" else None
    if whole is not None:
        assert (content, named(calls)) == (whole.content, whole.calls), reply
        if canonical(name) != "llama3_json":  # these are calls only at the end: none started and left open
            assert sorted(calls.names) == sorted(calls.done) or not whole.calls
    check_ids(name, [calls.ids[i] for i in calls.done])


def check_stream(name: str, pieces: list[str]) -> tuple[str, list[Call], list[str]]:
    """`ToolParser.stream` fed `pieces`: after every piece what `read_so_far` says; its content, calls and ids."""
    stream, content, calls, ids, seen = get_tool_parser(name).stream(), "", [], [], ""
    for piece in pieces:
        text, new = stream.feed(piece)
        content, calls, ids, seen = content + text, calls + [(c.name, c.arguments) for c in new], ids + [
            c.id for c in new], seen + piece
        expected = read_so_far(name, seen, streamed=False)
        assert (content, calls) == (expected.content, expected.calls), seen
    text, new = stream.finish()
    return content + text, calls + [(c.name, c.arguments) for c in new], ids + [c.id for c in new]


def check_reply(name: str, reply: str, sizes: list[int], expected: Reading) -> None:
    """`parse`, `stream` and ``delta_stream(True)``, whole and in the drawn pieces (and one character at a time),
    against the model's `expected` reading."""
    parsed = get_tool_parser(name).parse(reply)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected.calls, reply
    if expected.calls:
        assert parsed.content == (expected.content.strip() or None), reply
    else:
        assert parsed.content == (reply or None), reply  # no call: nothing the model wrote is lost
    check_ids(name, [c.id for c in parsed.tool_calls])
    for pieces in ([reply], pieces_of(reply, sizes), list(reply)):
        content, calls, ids = check_stream(name, pieces)
        assert (content, calls) == (expected.content, expected.calls), (reply, pieces)
        check_ids(name, ids)
        check_delta_stream(name, pieces, reply)


# ----------------------------------------------------------------------------------------------------------------
# Drawn replies.

JSON_STRING = st.lists(st.characters(blacklist_categories=("Cs",)) | st.sampled_from(
    ['"', "\\", "é", "😀", "Ω", "{", "}", "[", "]", "\n", "\x00", "\\u00e9", "<|python_tag|>", "[TOOL_CALLS]",
     "[ARGS]", "functools", "<|tool_call|>"]), max_size=6).map("".join)
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | JSON_STRING)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    JSON_STRING, inner, max_size=3), max_leaves=8)
JSON_ARGUMENTS = st.dictionaries(JSON_STRING, JSON_VALUES, max_size=4)
JSON_NAMES = st.sampled_from(["get_weather", "add", "f", "a.b", "x_1", "café", 'q"uote', "back\\slash", "{}", " sp "])
V11_NAMES = st.sampled_from(["get_weather", "add", "f", "a.b", "x-1", "café", "{}", "名前"])
"""``name[ARGS]`` names: text without the markers, nothing to strip."""


@st.composite
def json_text(draw: st.DrawFn, value: object) -> str:
    """`value` as a model may write it: drawn separators, indent and escapes."""
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" , ", " : ")]))
    return json.dumps(value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 0, 2])),
                      separators=separators)


def no_marker(text: str, markers: tuple[str, ...]) -> bool:
    return not any(m in text for m in markers)


def json_dicts(markers: tuple[str, ...] = ()) -> st.SearchStrategy[dict]:
    """Drawn arguments whose JSON text (either escaping) holds none of `markers`."""
    return JSON_ARGUMENTS.filter(lambda a: no_marker(json.dumps(a), markers) and no_marker(dumped(a), markers))


PROSE = ["Sure.", "I will check", " ", "\n", "a [b] c", "(x)", "]", "[", "}", "Ω é 😀", ";", ":", '"', "\\", "<|",
         "<|python", "[TOOL_", "[AR", "func", "functool", "<|tool", "<tool", "1, 2"]
"""Free text: the formats' markers' starts, brackets; never a ``{`` (prose with braces: `JUNK`)."""


def prose(markers: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(PROSE), max_size=4).map("".join).filter(lambda t: no_marker(t, markers))


@st.composite
def llama3_call(draw: st.DrawFn) -> tuple[str, Call]:
    name, arguments = draw(JSON_NAMES), draw(json_dicts() | st.none())
    key = draw(st.sampled_from(["parameters", "arguments"]))
    value = {"name": name, key: arguments} if draw(st.booleans()) else {key: arguments, "name": name}
    return draw(json_text(value)), (name, dumped(arguments))


@st.composite
def llama3_reply(draw: st.DrawFn) -> tuple[str, Reading]:
    """Text, then calls joined by separators (maybe with text between and after: dropped, as vLLM's), maybe after
    ``<|python_tag|>``."""
    drawn = draw(st.lists(llama3_call(), max_size=3))
    before = draw(st.sampled_from(["", PYTHON_TAG, " ", PYTHON_TAG + "\n"]) | prose(()))
    between = st.sampled_from(["; ", ";\n", ";", " ", "\n", ""]) | prose(())
    text = before + "".join(t + draw(between) for t, _ in drawn)
    return text, Reading("" if drawn else text, [c for _, c in drawn])


@st.composite
def mistral_reply(draw: st.DrawFn) -> tuple[str, Reading]:
    """Content, then ``[TOOL_CALLS]`` and a JSON list (maybe text after it), or ``name[ARGS]{...}`` calls."""
    content = draw(prose((TOOL_CALLS,)))
    if draw(st.booleans()):
        drawn = draw(st.lists(st.tuples(JSON_NAMES, json_dicts() | st.none()), min_size=1, max_size=3))
        listed = draw(json_text([{"name": n, "arguments": a} for n, a in drawn]))
        after = draw(st.sampled_from(["", "\n", " trailing [x] {y"]))
        text = content + TOOL_CALLS + draw(st.sampled_from(["", " ", "\n"])) + listed + after
    else:
        drawn = draw(st.lists(st.tuples(V11_NAMES, json_dicts((TOOL_CALLS,))), min_size=1, max_size=3))
        space = st.sampled_from(["", " ", "\n"])
        text = content + "".join(f"{TOOL_CALLS}{n}{ARGS}{draw(space)}{draw(json_text(a))}{draw(space)}"
                                 for n, a in drawn)
    return text, Reading(content, [(n, dumped(a)) for n, a in drawn])


@st.composite
def list_reply(draw: st.DrawFn, name: str) -> tuple[str, Reading]:
    """``granite``: an opener and a JSON list of calls (whitespace around); ``phi4_mini_json``: content,
    ``functools`` and a JSON list of calls, maybe text after it."""
    drawn = draw(st.lists(st.tuples(JSON_NAMES, json_dicts() | st.none()), min_size=1, max_size=3))
    listed = draw(json_text([{"name": n, "arguments": a} for n, a in drawn]))
    space = st.sampled_from(["", " ", "\n"])
    calls = [(n, dumped(a)) for n, a in drawn]
    if name == "granite":
        opener = draw(st.sampled_from(GRANITE_OPENERS))
        return draw(space) + opener + draw(space) + listed + draw(space), Reading("", calls)
    content = draw(prose((FUNCTOOLS,)))
    return content + FUNCTOOLS + draw(space) + listed + draw(st.sampled_from(["", " Done.", "\n{x"])), Reading(
        content, calls)


PY_KEYS = st.sampled_from(["city", "a", "b_2", "x", "données", "_k", "unit"])
PY_NAMES = st.sampled_from(["get_weather", "add", "f", "x_1", "café", "Tool2"])
PY_STRING = st.text(st.characters(blacklist_categories=("Cs",)) | st.sampled_from(
    ["'", '"', "\\", "é", "😀", "(", ")", "[", "]", "=", ",", "\n"]), max_size=6)
PY_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
              | st.floats(allow_nan=False, allow_infinity=False) | PY_STRING)
PY_VALUES = st.recursive(PY_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(
    tuple) | st.dictionaries(PY_STRING, inner, max_size=3), max_leaves=8)
"""Python literals JSON can write: a tuple is a JSON list."""


@st.composite
def pythonic_reply(draw: st.DrawFn) -> tuple[str, Reading]:
    drawn = draw(st.lists(st.tuples(PY_NAMES, st.dictionaries(PY_KEYS, PY_VALUES, max_size=3)), min_size=1,
                          max_size=3))
    comma = st.sampled_from([", ", ",", ",\n", " , "])
    calls = [f"{n}(" + draw(comma).join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in drawn]
    text = "[" + draw(comma).join(calls) + "]"
    if draw(st.booleans()):
        text = PYTHON_START + text + PYTHON_END
    return text + draw(st.sampled_from(["", "\n", " "])), Reading("", [(n, dumped(a)) for n, a in drawn])


REPLIES = {"llama3_json": llama3_reply(), "mistral": mistral_reply(), "granite": list_reply("granite"),
           "phi4_mini_json": list_reply("phi4_mini_json"), "pythonic": pythonic_reply()}
sizes_ = st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=12)
format_names = st.sampled_from(FORMATS)

NOT_CALLS = {
    "llama3_json": ['{"name": "f"}', '{"name": 1, "parameters": {}}', '{"name": "f", "parameters": [1]}',
                    '{"name": "f", "arguments": "{}"}', '{"parameters": {"a": 1}}', '{"name": null, "arguments": {}}',
                    '{"name": "f", "parameters": {invalid json}', "{not json}", '{"name": "f", "parameters": {"a": 1}',
                    "Use {braces} and [brackets].", "{", "}{", '<|python_tag|>{"name": "f"}', "{'name': 'f'}",
                    '{"a": {"b": 1}} and {}', '{"name": "f", "parameters": {"a": 01}}', '{"name": "f",, }'],
    "pythonic": ["[1, 2]", "[f(1)]", "[f(x=y)]", "[f(**k)]", "[broken(", "[]", "[a.b(x=1)]", "[f(x={1, 2})]",
                 "[f(x=b'1')]", "[f(x=1j)]", "[f(x=1)] trailing", "See [note] (x).", "Plain text.", "x [f(a=1)]",
                 "[f(a=1, a=2)]", "[f(a=1)", "(f(a=1))", "[f(a=1) g(b=2)]", "[f(a=1)][g(b=2)]", "[lambda: 1]"],
    "mistral": ['[TOOL_CALLS]f[ARGS]{"x": ', "[TOOL_CALLS]f{}", "[TOOL_CALLS][1]", "[TOOL_CALLS][ARGS]{}",
                "[TOOL_CALLS][]", '[TOOL_CALLS]f[ARGS]{"s": "[TOOL_CALLS]"}',
                "[TOOL_CALLS]f[ARGS]{}\xa0[TOOL_CALLS]g[ARGS]{}", '[TOOL_CALLS][{"name": "f"},]',
                '[TOOL_CALLS][{"name": "f", "arguments": [1]}]', "[TOOL_CALLS]f[ARGS]{} x",
                '[TOOL_CALLS][{"arguments": {}}]', "[TOOL_CALLS]", "Bonjour [TOOL_ et [ARGS]", "[TOOL_CALLS]f[ARGS][1]",
                '[TOOL_CALLS]{"name": "f", "arguments": {}}', "[TOOL_CALLS] [1, 2] x"],
    "granite": ["<|tool_call|>[not json]", "<|tool_call|>[]", '<|tool_call|>[{"name": "f", "arguments": {}}] x',
                'x <|tool_call|>[{"name": "f", "arguments": {}}]', '<tool_call>{"name": "f", "arguments": {}}',
                '<|tool_call|>[{"name": "f", "arguments": "{}"}]', "<|tool_call|>", "no call here", "<|tool",
                '<tool_call>[{"name": 1, "arguments": {}}]', '[{"name": "f", "arguments": {}}]',
                '<|tool_call|>f[ARGS]{"a": 1}', "<tool_call>f[ARGS]{}"],
    "phi4_mini_json": ["I used functools.partial here.", "functools[]", 'functools[{"name": 1, "arguments": {}}]',
                       "functools[not json]", 'functools{"name": "f", "arguments": {}}', "functools", "func tools",
                       '[{"name": "f", "arguments": {}}]', 'functools [{"name": "f", "arguments": [1]}] x',
                       'functools f[ARGS]{"a": 1}', "x functools g[ARGS]{}"],
}
"""Replies that hold no call, by the docs (malformed JSON, name-less or argument-less objects, prose with brackets,
the formats' markers in the wrong place)."""
ALIASES = {name: NOT_CALLS[canonical(name)] for name in FORMATS}


# ----------------------------------------------------------------------------------------------------------------
# The properties.


@settings(max_examples=EXAMPLES, deadline=None, **PHASES)
@given(name=format_names, data=st.data(), sizes=sizes_, reply=st.none())
@example(name="llama3_json", data=None, sizes=[3], reply=(
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par\\u00eds \\"x\\""}}; '
    '{"arguments": {"n": [1, 2.5e-3, null, true]}, "name": "add"}', Reading("", [
        ("get_weather", '{"city": "París \\"x\\""}'), ("add", '{"n": [1, 0.0025, null, true]}')])))
@example(name="mistral", data=None, sizes=[5, 1], reply=(
    'Let me see.[TOOL_CALLS]get_weather[ARGS] {"city": "Paris"}\n[TOOL_CALLS]add[ARGS]{}',
    Reading("Let me see.", [("get_weather", '{"city": "Paris"}'), ("add", "{}")])))
@example(name="pythonic", data=None, sizes=[2], reply=(
    "<|python_start|>[f(a=(1, 'x'), b={'k': None}), g()]<|python_end|>", Reading("", [
        ("f", '{"a": [1, "x"], "b": {"k": null}}'), ("g", "{}")])))
def test_drawn_calls_read_as_drawn(name: str, data: st.DataObject | None, sizes: list[int],
                                                   reply: tuple[str, Reading] | None) -> None:
    """A reply rendered from drawn calls in the documented format: the model reads the drawn calls and content;
    the parser, whole, as `stream` and as ``delta_stream(True)``, in any pieces, reads the same."""
    if reply is None:
        assert data is not None
        reply = data.draw(REPLIES[canonical(name)])
    text, drawn = reply
    if canonical(name) != "pythonic":
        assert read(name, text) == drawn, text
    check_reply(name, text, sizes, drawn)


@settings(max_examples=EXAMPLES, deadline=None, **PHASES)
@given(name=format_names, data=st.data(), sizes=sizes_)
def test_text_that_is_no_call_is_content(name: str, data: st.DataObject, sizes: list[int]) -> None:
    """Malformed calls and prose, alone or around drawn text: no call, all of the reply content, as written."""
    markers = {"llama3_json": ("{",), "mistral": (TOOL_CALLS,), "phi4_mini_json": (FUNCTOOLS,), "granite": (),
               "pythonic": ()}[canonical(name)]
    text = data.draw(st.sampled_from(ALIASES[name]))
    if canonical(name) in ("llama3_json", "mistral", "phi4_mini_json"):  # text around it (before the opener)
        text = data.draw(prose(markers)) + text + data.draw(prose(markers + ("}",)))
    assert read(name, text) == Reading(text, []), text
    check_reply(name, text, sizes, Reading(text, []))


def fragments(name: str) -> st.SearchStrategy[str]:
    """Pieces of replies: calls, malformed calls, prose, markers."""
    name = canonical(name)
    markers = {"llama3_json": [PYTHON_TAG, "{", "}", ";", '"name": "f", ', '"parameters": {"a": 1}}'],
               "mistral": [TOOL_CALLS, ARGS, "f", "{}", "[", "]", ","],
               "granite": [*GRANITE_OPENERS, "[", "]", ",", "\n"],
               "phi4_mini_json": [FUNCTOOLS, "[", "]", ",", " "]}[name]
    calls = REPLIES[name].map(lambda r: r[0])
    return st.one_of(calls, st.sampled_from(NOT_CALLS[name] + markers + PROSE))


@settings(max_examples=2 * EXAMPLES, deadline=None, **PHASES)
@given(name=st.sampled_from(["llama3_json", "mistral", "granite", "phi4_mini_json"]), data=st.data(), sizes=sizes_,
       cut=st.none() | st.integers(min_value=0), reply=st.none())
@example(name="llama3_json", data=None, sizes=[1], cut=None,
         reply='{"a": {"name": "f", "parameters": {}}, "b": [')  # a call inside an object the end cut off
@example(name="llama3_json", data=None, sizes=[2], cut=None,
         reply='{"x": {"name": "f", "parameters": {}}} {"name": "g", "arguments": {"k": "}"}}')
@example(name="mistral", data=None, sizes=[4], cut=None,
         reply='[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}] {"name": "g"} [TOOL_CALLS]x')
def test_any_reply_reads_as_the_model(name: str, data: st.DataObject | None, sizes: list[int], cut: int | None,
                                      reply: str | None) -> None:
    """Any mix of calls, malformed calls, prose and markers (cut anywhere: max_tokens): the parsers read what the
    model reads, whole and in any pieces, and hold back no more than the docs let them."""
    if reply is None:
        assert data is not None
        reply = "".join(data.draw(st.lists(fragments(name), max_size=5)))
    if cut is not None:
        reply = reply[:cut % (len(reply) + 1)]
    check_reply(name, reply, sizes, read(name, reply))


@settings(max_examples=EXAMPLES // 2, deadline=None, **PHASES)
@given(name=st.sampled_from(["pythonic", "llama4_pythonic"]), data=st.data(), sizes=sizes_,
       cut=st.integers(min_value=0))
def test_pythonic_cut_anywhere_streams_as_whole(name: str, data: st.DataObject, sizes: list[int], cut: int) -> None:
    """A pythonic reply cut anywhere (max_tokens): whole calls only if it is still the whole list, else all content;
    streamed in any pieces, the same, held back only while it may open with ``[``."""
    full, drawn = data.draw(pythonic_reply())
    text = full[:cut % (len(full) + 1)]
    expected = drawn if core(text) == core(full) else Reading(text, [])  # the list whole, or not calls
    check_reply(name, text, sizes, expected)


def core(text: str) -> str:
    """A pythonic reply less the whitespace and ``<|python_start|>`` / ``<|python_end|>`` around its list."""
    return text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()


def test_aliases_are_the_same_formats() -> None:
    """``llama4_json`` is ``llama3_json``, ``llama4_pythonic`` is ``pythonic``; ``mistral`` and ``granite`` keep
    special tokens (their openers are special tokens), the others do not need them."""
    assert all(name in TOOL_PARSERS for name in FORMATS)
    assert type(get_tool_parser("llama4_json")) is type(get_tool_parser("llama3_json"))
    assert type(get_tool_parser("llama4_pythonic")) is type(get_tool_parser("pythonic"))
    assert [get_tool_parser(n).needs_special_tokens for n in FORMATS] == [False, False, False, False, True, True,
                                                                          False]


def test_json_prefix_reader() -> None:
    """The model's own reader of a JSON value's start (the bound on what ``llama3_json`` holds)."""
    for good in ['{', '{"a', '{"a": tr', '{"a": 1', '{"a": -', '{"a": 1.', '{"a": 1e', '{"a": "\\u00', '{"a": [1, ',
                 '{"a": -Inf', '{"a": 0', '{"a": {}}', '{"a": 1.5e+']:
        assert json_prefix(good), good
    for bad in ['{a', '{"a" 1', '{"a": 01', '{"a": 1.e', '{"a": tx', '{"a": "\\x', '{"a": "\n', '{,', '{"a": [1 2',
                '{"a": nul1']:
        assert not json_prefix(bad), bad


@pytest.mark.parametrize("name, text", [("granite", '<|tool_call|>f[ARGS]{"a": 1}'),
                                        ("phi4_mini_json", 'x functools g[ARGS]{"a": 1}')])
def test_granite_and_phi4_read_only_a_json_list(name: str, text: str) -> None:
    """Mistral v11's ``name[ARGS]{...}`` after their opener is no call (vLLM's parsers read only a JSON list)."""
    parsed = get_tool_parser(name).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize("text", ['{"a": 01', '{"a": tx', '{"a": 1.e5', '{"name": "f", "parameters": {"n": -a'])
def test_llama3_json_releases_an_object_at_its_first_character_json_refuses(text: str) -> None:
    """The object's text can no longer be JSON: it is content at once (no ``{`` after it to try)."""
    parts = get_tool_parser("llama3_json").delta_stream(True).feed(text)
    assert "".join(p for p in parts if isinstance(p, str)) == text


def test_llama3_json_streamed_content_keeps_a_leading_python_tag_before_text() -> None:
    """Held while it may precede a call, the tag goes out with the text that follows it (vLLM's content keeps it)."""
    text = '<|python_tag|>Checking. {"name": "f", "parameters": {}}'
    parts = get_tool_parser("llama3_json").delta_stream(True).feed(text)
    assert "".join(p for p in parts if isinstance(p, str)) == "<|python_tag|>Checking. "
    parts = get_tool_parser("llama3_json").delta_stream(True).feed('<|python_tag|> ;{"name": "f", "parameters": {}}')
    assert not [p for p in parts if isinstance(p, str)]
