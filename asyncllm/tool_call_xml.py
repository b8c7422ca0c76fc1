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

As vLLM's regexes read them, a parameter's ``</parameter>`` may be left out (the next ``<parameter=``, the
``</function>`` or the block's end ends it; Seed-OSS's: only the block's end), and so may a block's ``</function>``
and the last block's ``</tool_call>``: at the reply's end an open block whose text is one whole call is that call
(text after its ``</function>`` is not read, as vLLM's regex stops there, so a reply cut inside the closing tags is
still its call).
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
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>))", re.DOTALL)
CLOSED_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_LAST_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?=(?:</function>\s*)?\Z)", re.DOTALL)
"""At the block's end, a parameter that nothing closed: its value runs to the block's end (or its ``</function>``)."""
_STRINGS = ("string", "str", "text", "varchar", "char", "enum")


def parameter_types(functions: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Function name -> parameter name -> its JSON-schema ``type`` (the first of a list)."""
    types: dict[str, dict[str, str]] = {}
    for name, function in functions.items():
        properties = (function.get("parameters") or {}).get("properties") or {}
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
    if kind.startswith("int") or kind in ("uint", "long", "short"):
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
        return int(number) if number.is_integer() and not any(c in text for c in ".eE") else number
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(text.lower(), text)
    for parse in (json.loads, ast.literal_eval):  # object, array, dict, list, and types the schema made up
        try:
            value = parse(text)
            json.dumps(value, allow_nan=False)  # a Python literal JSON cannot write (a set, bytes) stays text
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return text


class _Block:
    """One ``<tool_call>`` block's text as it comes: its function name, its finished parameters, and at its end
    whether it is one whole call."""

    def __init__(self, index: int, types: dict[str, dict[str, str]], parameter: re.Pattern[str] = _PARAMETER) -> None:
        self.index, self.id, self.text = index, tool_call_id(), ""
        self._types = types
        self._parameter = parameter
        self.name: str | None = None
        self.arguments: list[str] = []  # one '"key": value' per finished parameter
        self._end = 0  # where the text after the last finished parameter starts
        self.closed = False
        """Its text is one whole call (known at the block's end: `end`)."""
        self.started = False
        """Its first piece is out (streaming): it stays, whatever follows."""

    def feed(self, text: str) -> None:
        self.text += text
        if self.name is None:
            match = _FUNCTION.match(self.text)
            if match is None:
                return
            self.name, self._end = match.group(1).strip(), match.end()
        while (match := self._parameter.match(self.text, self._end)) is not None:
            self._add(match)

    def end(self) -> None:
        """The block's text ended: a last parameter runs to its end, and ``</function>`` is optional."""
        if self.name is not None and (match := _LAST_PARAMETER.match(self.text, self._end)) is not None:
            self._add(match)
        self.closed = self.name is not None and _ends_function(self.text[self._end:])

    def _add(self, match: re.Match[str]) -> None:
        key, value = match.group(1).strip(), match.group(2)
        value = value.removeprefix("\n").removesuffix("\n")
        kind = self._types.get(self.name or "", {}).get(key)
        self.arguments.append(f"{json.dumps(key)}: {json.dumps(typed_value(value, kind), ensure_ascii=False)}")
        self._end = match.end()

    def arguments_text(self) -> str:
        return "{" + ", ".join(self.arguments) + "}"


def _ends_function(rest: str) -> bool:
    """What may follow a block's last parameter, as vLLM's regexes read it: nothing, ``</function>`` and whatever
    follows it (the function's regex stops there), or the start of ``</function>`` (a reply cut short)."""
    rest = rest.lstrip()
    if rest.startswith("</function>"):
        return "<function=" not in rest  # a second function in the block: not built (the block is content)
    return "</function>".startswith(rest)


class XmlCallsStream(TaggedBlockStream):
    """``<tool_call>`` blocks of XML parameters; text outside them is content. A block whose text is not one
    whole call is content (one that started streaming stays as sent, its text content as well)."""

    LAST_CLOSE_OPTIONAL = True
    PARAMETER = _PARAMETER

    def __init__(self, stream_arguments: bool, types: dict[str, dict[str, str]]) -> None:
        super().__init__()
        self._stream = stream_arguments
        self._types = types
        self._call: _Block | None = None
        self._sent = 0  # the open block's parameters sent (streaming)

    def _open_block(self) -> None:
        self._call, self._sent = _Block(self._index, self._types, self.PARAMETER), 0

    def _feed_block(self, text: str) -> list[ReplyPart]:
        assert self._call is not None
        self._call.feed(text)
        return list(self._streamed(self._call)) if self._stream else []

    def _streamed(self, block: _Block) -> list[ToolCallDelta]:
        """The pieces of the open block not sent yet: its first piece once named, then each finished parameter."""
        if block.name is None:
            return []
        deltas = []
        if not block.started:
            block.started = True
            deltas.append(ToolCallDelta(block.index, "", block.name, block.id))
        for argument in block.arguments[self._sent:]:
            deltas.append(ToolCallDelta(block.index, ("{" if self._sent == 0 else ", ") + argument))
            self._sent += 1
        return deltas

    def _close_block(self) -> list[ReplyPart]:
        block, self._call = self._call, None
        assert block is not None
        block.end()
        return (self._streamed(block) if self._stream and block.closed else []) + self._closed(block)

    def _closed(self, block: _Block) -> list[ReplyPart]:
        if block.started:
            self._index = block.index + 1
        if block.name is None or not block.closed:  # not one whole call: its text is content
            return self._as_content()
        self._index, self._calls = block.index + 1, self._calls + 1
        if not self._stream:
            return [ToolCallDelta(block.index, block.arguments_text(), block.name, block.id, done=True)]
        return [ToolCallDelta(block.index, "}" if self._sent else "{}", done=True)]
