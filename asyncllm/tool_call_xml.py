"""Qwen3-Coder's tool calls: XML parameters inside ``<tool_call>`` blocks (vLLM's ``qwen3_coder`` parser).

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is its text less one newline at each end, typed by the tool's JSON schema as vLLM types it
(`typed_value`): ``integer`` and ``number`` parsed as numbers, ``boolean`` from true / false, ``object`` and
``array`` as JSON (or a Python literal), ``null`` as null, anything else (and a parameter the schema does not
name) a string. Streamed, a call's first piece comes once ``<function=NAME>`` is read and its arguments one
parameter at a time, each as soon as its ``</parameter>`` is: joined, they are the JSON object of the whole call.

A block may hold several functions, each its own call (vLLM's function regex finds every one); the block's text
before its first ``<function=`` must be whitespace, or the block is content. As vLLM's regexes read them, text in a
function that is no parameter (between its parameters, or after its last one) and text after a ``</function>`` up to
the next ``<function=`` are not read; a parameter's ``</parameter>`` may be left out (the next ``<parameter=``, the
``</function>`` or the block's end ends it; Seed-OSS's: only the ``</function>`` or the block's end), and so may a
function's ``</function>`` and the last block's ``</tool_call>``: a function still open at the block's end is a call
(so a reply cut inside its closing tags is still its calls). A value that such an end cuts off loses one more
newline at its end, as ``$`` in vLLM's regexes also matches before a last newline (and a block the reply's end cuts
off, one more).

This follows vLLM's regex parser (commit 0b13f933), not the current one, which scans the tags (commit 00d0a333)
and reads differently: it takes only the first function of a block (and drops the later ones, which here are
calls); it still calls a block with text before its first ``<function=`` (here the block is content); it rejects a
template-like name such as ``{{ tc.name }}`` (here it is the call's name); and it skips a literal ``</parameter>``
inside code in a value (here it ends the value).

Streamed, the block's text is read only when a piece holds a tag the reader waits for, so a long value fed in
small pieces is read once (linear, not quadratic, time on the server's event loop).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from asyncllm.tool_call_streams import ReplyPart, TaggedBlockStream, ToolCallDelta, tool_call_id

__all__ = ["XmlCallsStream", "parameter_types", "typed_value", "CLOSED_PARAMETER"]

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
"""A block's first function: only whitespace before it (other text makes the block content)."""
_NEXT_FUNCTION = re.compile(r"<function=([^>\n]+)>")
"""A later function: the text before it, after the last one's ``</function>``, is not read."""
_FUNCTION_END = "</function>"
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=))", re.DOTALL)
CLOSED_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_OPEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*)", re.DOTALL)
"""At a function's end, a parameter that nothing closed: its value runs to that end."""
_STRINGS = ("string", "str", "text", "varchar", "char", "enum")


def parameter_types(functions: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Function name -> parameter name -> its JSON-schema ``type`` (the first of a list); ``properties`` that is no
    object names no parameter (every value a string)."""
    types: dict[str, dict[str, str]] = {}
    for name, function in functions.items():
        properties = (function.get("parameters") or {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        types[name] = {}
        for key, schema in properties.items():
            kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
            types[name][key] = str(kind[0] if isinstance(kind, list) and kind else kind).lower()
    return types


def typed_value(text: str, kind: str | None) -> Any:
    """A parameter's text as its schema type reads it; the text itself when it does not parse as that type."""
    if text.lower() == "null":
        return None
    kind = kind or "string"
    if kind in _STRINGS:
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):  # JSON has no nan or inf
            return text
        return int(number) if number.is_integer() else number  # as vLLM's: 2.0 and 1e3 are ints
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"  # as vLLM's: anything else is false
    for parse in (json.loads, ast.literal_eval):  # object, array, dict, list, and types the schema made up
        try:
            value = parse(text)
            json.dumps(value, allow_nan=False)  # a Python literal JSON cannot write (a set, bytes) stays text
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return text


class _Function:
    """One ``<function=NAME>`` of a block, a call: its parameters as they finish, its pieces as they are sent."""

    def __init__(self, index: int, name: str, types: dict[str, str]) -> None:
        self.index, self.id, self.name = index, tool_call_id(), name
        self._types = types
        self.arguments: list[str] = []  # one '"key": value' per finished parameter
        self.ended = False
        """Its ``</function>`` (or the block's end) came: no more parameters."""
        self.done = False
        """Its last piece is out."""
        self._started = False
        self._sent = 0  # parameters sent (streaming)

    def add(self, match: re.Match[str], at_end: bool = False) -> None:
        """A parameter's match; `at_end`: its value runs to the function's end, where vLLM's ``$`` also matches
        before a last newline, so one more newline goes."""
        value = match.group(2).removesuffix("\n") if at_end else match.group(2)
        key, value = match.group(1).strip(), value.removeprefix("\n").removesuffix("\n")
        value_text = json.dumps(typed_value(value, self._types.get(key)), ensure_ascii=False)
        self.arguments.append(f"{json.dumps(key, ensure_ascii=False)}: {value_text}")

    def pieces(self, stream_arguments: bool) -> list[ToolCallDelta]:
        """Its pieces not sent yet: streamed, its first piece, then each finished parameter, then its close once
        it ended; else the whole call once it ended."""
        if not stream_arguments:
            self.done = self.ended
            arguments = "{" + ", ".join(self.arguments) + "}"
            return [ToolCallDelta(self.index, arguments, self.name, self.id, done=True)] if self.ended else []
        deltas = [] if self._started else [ToolCallDelta(self.index, "", self.name, self.id)]
        self._started = True
        for argument in self.arguments[self._sent:]:
            deltas.append(ToolCallDelta(self.index, ("{" if self._sent == 0 else ", ") + argument))
            self._sent += 1
        if self.ended:
            self.done = True
            deltas.append(ToolCallDelta(self.index, "}" if self._sent else "{}", done=True))
        return deltas


class _Block:
    """One ``<tool_call>`` block's text as it comes, read into its functions (calls) and their parameters."""

    def __init__(self, index: int, types: dict[str, dict[str, str]], parameter: re.Pattern[str],
                 parameter_ends: tuple[str, ...]) -> None:
        self.index = index  # the index of its first call
        self.functions: list[_Function] = []
        self._types = types
        self._parameter, self._parameter_ends = parameter, parameter_ends
        self._text = ""  # the block's text from where the last read stopped (what it read is dropped)
        self._pos = 0  # where the text not read yet starts
        self._more: list[str] = []  # text fed after `_text`, holding no tag the reader waits for
        self._overlap = max(map(len, (_FUNCTION_END, *parameter_ends))) - 1
        self._tail = ""  # the last `_overlap` characters fed: a tag may start in them and end in the next feed
        self._open = False  # the last function's end has not come

    def feed(self, text: str) -> None:
        """Only text with a tag the reader waits for (a parameter's or function's end while a function is open,
        else the ``>`` that ends ``<function=NAME>``) can read more, so only such a feed reads the text: a long
        parameter fed in small pieces is read once, not once a piece."""
        self._more.append(text)
        window = self._tail + text
        self._tail = window[-self._overlap:]
        waited = (_FUNCTION_END, *self._parameter_ends) if self._open else (">",)
        if any(tag in window for tag in waited):
            self._catch_up()
            while self._read():
                pass
            self._text, self._pos = self._text[self._pos:], 0

    def end(self, reply_end: bool) -> None:
        """The block's text ended (`reply_end`: the reply's end, not its closing tag, where vLLM's ``$`` leaves out
        a last newline): so does a function still open."""
        self._catch_up()
        if reply_end:
            self._text = self._text.removesuffix("\n")
        if self._open:
            self._end_function(len(self._text))

    def _catch_up(self) -> None:
        self._text += "".join(self._more)
        self._more = []

    def _read(self) -> bool:
        """A function opened, or the open one ended; False when the text so far holds no more."""
        if not self._open:
            return self._open_function()
        end = self._text.find(_FUNCTION_END, self._pos)
        while (match := self._parameter.search(self._text, self._pos, len(self._text) if end < 0 else end)):
            self.functions[-1].add(match)
            self._pos = match.end()
        if end < 0:
            return False
        self._end_function(end)
        self._pos = end + len(_FUNCTION_END)
        return True

    def _open_function(self) -> bool:
        if self.functions:
            match = _NEXT_FUNCTION.search(self._text, self._pos)
            if match is None:  # the text between is not read: a function yet to come starts past its last '>'
                # (no tag or name holds one), so the next search starts there, not again at the last one's end
                self._pos = max(self._pos, self._text.rfind(">", self._pos) + 1)
        else:
            match = _FUNCTION.match(self._text, self._pos)
        if match is None:
            return False
        name = match.group(1).strip()
        self.functions.append(_Function(self.index + len(self.functions), name, self._types.get(name, {})))
        self._pos, self._open = match.end(), True
        return True

    def _end_function(self, end: int) -> None:
        """The open function ends at `end`: a parameter still open runs to it, and text after its last parameter
        is not read (vLLM's parameter regex skips it)."""
        if (match := _OPEN_PARAMETER.search(self._text, self._pos, end)) is not None:
            self.functions[-1].add(match, at_end=True)
        self.functions[-1].ended, self._open = True, False


class XmlCallsStream(TaggedBlockStream):
    """``<tool_call>`` blocks of XML functions, each function a call; text outside them is content. A block with
    no function (or text before its first one) is content."""

    LAST_CLOSE_OPTIONAL = True
    PARAMETER = _PARAMETER
    PARAMETER_ENDS = ("</parameter>", "<parameter=")
    """The tags that end a parameter (`PARAMETER`'s ends): only one in new text can finish a parameter."""

    def __init__(self, stream_arguments: bool, types: dict[str, dict[str, str]]) -> None:
        super().__init__()
        self._stream = stream_arguments
        self._types = types
        self._calls_block: _Block | None = None

    def _open_block(self) -> None:
        self._calls_block = _Block(self._index, self._types, self.PARAMETER, self.PARAMETER_ENDS)

    def _feed_block(self, text: str) -> list[ReplyPart]:
        assert self._calls_block is not None
        self._calls_block.feed(text)
        return self._pieces(self._calls_block)

    def _close_block(self) -> list[ReplyPart]:
        block, self._calls_block = self._calls_block, None
        assert block is not None
        block.end(self._unclosed)
        if not block.functions:
            return self._as_content()
        self._index = block.index + len(block.functions)
        return self._pieces(block)

    def _pieces(self, block: _Block) -> list[ReplyPart]:
        """The pieces of the block's calls not sent yet (a function is a call once named, so none is taken back)."""
        parts: list[ReplyPart] = []
        for function in block.functions:
            if not function.done:
                parts += function.pieces(self._stream)
                self._calls += int(function.done)
        return parts
