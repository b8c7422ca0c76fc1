"""The tool-call formats with their own markers, read naively by their docs: the model that
tests/unit/test_tool_call_formats_property.py checks asyncllm's parsers against (and its drawn tools).

The model (`reference`) reads by the modules' docstrings and docs/integrations/openai-server.md: the reply's text
is split at the format's opening tag; a block runs to its first closing tag. A block with its closing tag is read by
the format's reader (`READERS`, written from the docs): calls, or content (its text, tags and all). A block the
reply's end cut off is content, except in the XML formats, whose last ``</tool_call>`` may be left out (its functions
still open end there, a cut-off value loses one more newline, and the block's text one more). Content is the text
between, less the section markers; after a call, text between calls (and after the last one) that is only whitespace
is no content. Calls are numbered from 0 in order; ``kimi_k2``'s id is its ``functions.NAME:N``, the others' fresh
``call_`` ids. ``deepseek_v3`` / ``deepseek_v31`` / ``kimi_k2`` arguments are the JSON object's text as written
(``kimi_k2``'s stripped); the others' ``json.dumps(..., ensure_ascii=False)`` of the object (the XML formats': of
their typed parameters in order).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field

DS_BEGIN, DS_END, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁sep｜>"
DS_CALL, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
JSON_SPACE = " \t\n\r"


@dataclass(frozen=True)
class Format:
    """A format: its opening and closing tags, the section markers around its calls (never content)."""

    name: str
    open: str
    close: str
    markers: tuple[str, ...] = ()

    @property
    def xml(self) -> bool:
        return self.name in ("qwen3_coder", "seed_oss")


FORMATS = {f.name: f for f in [
    Format("deepseek_v3", DS_CALL, DS_CALL_END, (DS_BEGIN, DS_END)),
    Format("deepseek_v31", DS_CALL, DS_CALL_END, (DS_BEGIN, DS_END)),
    Format("kimi_k2", KIMI_CALL, KIMI_CALL_END, (KIMI_BEGIN, KIMI_END)),
    Format("glm45", "<tool_call>", "</tool_call>"),
    Format("minimax_m2", "<minimax:tool_call>", "</minimax:tool_call>"),
    Format("hunyuan_a13b", "<tool_calls>", "</tool_calls>"),
    Format("jamba", "<tool_calls>", "</tool_calls>"),
    Format("qwen3_coder", "<tool_call>", "</tool_call>"),
    Format("seed_oss", "<seed:tool_call>", "</seed:tool_call>"),
]}

SCHEMA_TYPES = {"city": "string", "n": "integer", "x": "number", "flag": "boolean", "obj": "object", "arr": "array",
                "maybe": ["integer", "null"], "note": None}
"""The drawn parameters' schema types (None: the schema does not name it, a string)."""
NAMES = ["get_weather", "add", "f", "x_1", "a.b", "untyped"]
FUNCTIONS = {name: {"name": name, "parameters": {"type": "object", "properties": {
    key: {"type": kind} for key, kind in SCHEMA_TYPES.items() if kind is not None}}} for name in NAMES[:-1]}
"""The tools offered: every drawn name but ``untyped`` (whose parameters are strings)."""
TOOLS = [{"type": "function", "function": function} for function in FUNCTIONS.values()]


# ----------------------------------------------------------------------------------------------------------------
# The model: values typed as the docs say, each format's reader, the reply split at the tags.


def schema_type(key: str, function: str | None = None) -> str:
    """`key`'s type in `function`'s schema (a function the tools do not offer: a string)."""
    kind = SCHEMA_TYPES.get(key) if function is None or function in FUNCTIONS else None
    return (kind[0] if isinstance(kind, list) else kind or "string").lower()


def typed(text: str, kind: str) -> object:
    """The docs' typing: ``null`` (any case) is null; integer / number as numbers (a whole number an int, not
    finite: text); boolean true from ``true`` in any case, else false; object / array as JSON or a Python literal
    JSON can write; a string, or anything that does not fit, the text."""
    if text.lower() == "null":
        return None
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return text
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return text
        return text if not math.isfinite(number) else int(number) if number == int(number) else number
    if kind == "boolean":
        return text.lower() == "true"
    if kind in ("object", "array"):
        for read in (json.loads, ast.literal_eval):
            try:
                value = read(text)
                json.dumps(value, allow_nan=False)
                return value
            except (ValueError, SyntaxError, TypeError):
                pass
    return text


def dumped(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def json_object_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def read_deepseek_v3(body: str) -> list | None:
    """``[function]<｜tool▁sep｜>NAME``, then a fenced JSON block (```` ```json ```` or ```` ``` ````): the object
    as written."""
    match = re.fullmatch(r"\s*(?:function)?" + re.escape(DS_SEP) + r"(.+?)\n```(?:json)?\n(.*)\n```\s*", body, re.S)
    if match is None or not json_object_text(match.group(2)):
        return None
    return [(match.group(1).strip(), match.group(2), None)]


def read_deepseek_v31(body: str) -> list | None:
    """``NAME<｜tool▁sep｜>{...}``: the object as written."""
    name, sep, rest = body.partition(DS_SEP)
    if not sep or not name.strip() or not json_object_text(rest):
        return None
    return [(name.strip(), rest, None)]


def read_kimi_k2(body: str) -> list | None:
    """``functions.NAME:N<|tool_call_argument_begin|>{...}``: id ``functions.NAME:N``, the object less the spaces
    around it."""
    head, sep, rest = body.partition(KIMI_ARGS)
    match = re.fullmatch(r"\s*(functions\.([^:\s]+):\d+)\s*", head)
    if not sep or match is None or not json_object_text(rest.strip()):
        return None
    return [(match.group(2), rest.strip(), match.group(1))]


def read_glm45(body: str) -> list | None:
    """``NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs (whitespace around), each key and value
    stripped, the value typed."""
    name, _, _ = body.partition("<arg_key>")
    name = name.strip()
    if not name or "<" in name or "\n" in name:
        return None
    rest, arguments = body[body.find("<arg_key>"):] if "<arg_key>" in body else "", {}
    pair = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
    while (match := pair.match(rest)) is not None:
        arguments[match.group(1).strip()] = typed(match.group(2).strip(),
                                                  schema_type(match.group(1).strip(), name))
        rest = rest[match.end():]
    return [(name, dumped(arguments), None)] if not rest.strip() else None


def read_minimax_m2(body: str) -> list | None:
    """One or more ``<invoke name="NAME">`` of ``<parameter name="K">V</parameter>`` (whitespace between), a value
    less one newline at each end, typed."""
    calls, rest = [], body
    invoke = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>', re.S)
    parameter = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>', re.S)
    while (match := invoke.match(rest)) is not None:
        inner, arguments = match.group(2), {}
        while (param := parameter.match(inner)) is not None:
            value = param.group(2).removeprefix("\n").removesuffix("\n")
            arguments[param.group(1)] = typed(value, schema_type(param.group(1), match.group(1)))
            inner = inner[param.end():]
        if inner.strip():
            return None
        calls.append((match.group(1), dumped(arguments), None))
        rest = rest[match.end():]
    return calls if calls and not rest.strip() else None


def read_json_list(body: str) -> list | None:
    """A non-empty JSON list of ``{"name": str, "arguments": {...}}`` (arguments left out: ``{}``)."""
    try:
        values = json.loads(body)
    except ValueError:
        return None
    if not isinstance(values, list) or not values:
        return None
    calls = []
    for value in values:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        if not isinstance(value.get("arguments", {}), dict):
            return None
        calls.append((value["name"], dumped(value.get("arguments", {})), None))
    return calls


@dataclass
class Function:
    """An XML function as read so far: name, finished parameters ('"key": value' texts), whether it ended."""

    name: str
    arguments: list[str] = field(default_factory=list)
    ended: bool = False

    @property
    def text(self) -> str:
        return "{" + ", ".join(self.arguments) + "}"


HEADER = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>")


def xml_functions(body: str, seed: bool, final: bool, reply_end: bool) -> list[Function] | None:
    """The docs' XML reading of a block's text: the first ``<function=NAME>`` after whitespace only (else None: the
    block is content), later ones anywhere after the last one's end; a function runs to its ``</function>`` (or the
    block's end); in it each ``<parameter=K>`` runs to ``</parameter>`` (qwen3_coder: or the next ``<parameter=``),
    or to the function's end (one more newline off its value); a value less one newline at each end. `final`: the
    block ended (else: what the text so far says for sure); `reply_end`: the reply's end cut it (one newline off)."""
    if reply_end:
        body = body.removesuffix("\n")
    first = re.match(r"\s*" + HEADER.pattern, body)
    if first is None:
        return None
    functions, pos = [], first.start(1) - len("<function=")
    while (header := HEADER.search(body, pos)) is not None:
        function = Function(header.group(1).strip())
        functions.append(function)
        end = body.find("</function>", header.end())
        inner = body[header.end():] if end < 0 else body[header.end():end]
        ends = ["</parameter>"] if seed else ["</parameter>", "<parameter="]
        at = 0
        while (param := PARAMETER.search(inner, at)) is not None:
            stops = [i for i in (inner.find(tag, param.end()) for tag in ends) if i >= 0]
            if stops:
                value, at = inner[param.end():min(stops)], min(stops) + (len("</parameter>") if inner.startswith(
                    "</parameter>", min(stops)) else 0)
            elif end >= 0 or final:
                value, at = inner[param.end():].removesuffix("\n"), len(inner)
            else:
                break  # still open
            key, value = param.group(1).strip(), value.removeprefix("\n").removesuffix("\n")
            value_text = json.dumps(typed(value, schema_type(key, function.name)), ensure_ascii=False)
            function.arguments.append(f"{json.dumps(key, ensure_ascii=False)}: {value_text}")
        function.ended = end >= 0 or final
        if end < 0:
            break
        pos = end + len("</function>")
    return functions


READERS = {"deepseek_v3": read_deepseek_v3, "deepseek_v31": read_deepseek_v31, "kimi_k2": read_kimi_k2,
           "glm45": read_glm45, "minimax_m2": read_minimax_m2, "hunyuan_a13b": read_json_list,
           "jamba": read_json_list}


def partial(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `tags`."""
    return max([n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])], default=0)


def unmarked(text: str, markers: tuple[str, ...]) -> str:
    """`text` with no section marker left in it."""
    while any(marker in text for marker in markers):
        for marker in markers:
            text = text.replace(marker, "")
    return text


@dataclass
class Reading:
    """The model's reading: content by runs (``runs[k]``: the content after the reply's k-th call; before `parse`
    strips it), calls (index, name, arguments, id or None), and for streamed XML arguments the calls started so far
    (index -> name, arguments so far)."""

    runs: list[str]
    calls: list[tuple[int, str, str, str | None]]
    started: dict[int, tuple[str, str]]

    @property
    def content(self) -> str:
        return "".join(self.runs)


def reference(fmt: Format, text: str, whole: bool = True) -> Reading:
    """The model's reading of `text`: the whole reply, or (not `whole`) the text so far of a reply still coming, less
    what the parser may not know yet."""
    pieces: list[str | list] = []  # content text, or a block's calls [(name, arguments, id)]
    started: dict[int, tuple[str, str]] = {}
    pos = 0
    while True:
        start = text.find(fmt.open, pos)
        if start < 0:
            rest = text[pos:]
            if not whole:  # a possible tag's start: held
                rest = rest[:len(rest) - partial(rest, (fmt.open, *fmt.markers))]
            pieces.append(rest)
            break
        pieces.append(text[pos:start])
        body_start = start + len(fmt.open)
        end = text.find(fmt.close, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        if end < 0 and not whole:  # an unfinished block: held (XML: its functions so far)
            if fmt.xml:
                body = body[:len(body) - partial(body, (fmt.close,))]
                functions = xml_functions(body, fmt.name == "seed_oss", final=False, reply_end=False) or []
                index = sum(len(p) for p in pieces if isinstance(p, list))
                pieces.append([(f.name, f.text, None) for f in functions if f.ended])
                for i, f in enumerate(functions):
                    started[index + i] = (f.name, f.text if f.ended else f.text[:-1] if f.arguments else "")
            break
        if fmt.xml:
            functions = xml_functions(body, fmt.name == "seed_oss", final=True, reply_end=end < 0)
            calls = [(f.name, f.text, None) for f in functions] if functions else None
        else:
            calls = READERS[fmt.name](body) if end >= 0 else None
        pieces.append(calls if calls else fmt.open + body + (fmt.close if end >= 0 else ""))
        if end < 0:
            break
        pos = end + len(fmt.close)
    return assembled(fmt, pieces, started)


def assembled(fmt: Format, pieces: list[str | list], started: dict[int, tuple[str, str]]) -> Reading:
    """Content and calls of the pieces: the content between calls less the markers, and none of it when only
    whitespace after a call."""
    runs, calls, run = [], [], ""
    for piece in [*pieces, [None]]:
        if isinstance(piece, str):
            run += piece
            continue
        for call in piece:
            run = unmarked(run, fmt.markers)
            runs.append("" if calls and not run.strip() else run)
            run = ""
            if call is not None:
                calls.append((len(calls), *call))
    for index, name, arguments, _ in calls:
        started.setdefault(index, (name, arguments))
    return Reading(runs, calls, started)
