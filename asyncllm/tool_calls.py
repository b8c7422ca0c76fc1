"""Tool calling: the tools a chat template renders, and parsers of the calls a model writes.

A chat model that calls tools writes them as text in a format its chat
template taught it; a parser turns that text back into `ToolCall`s. The
parsers are vLLM's names for the same formats (``--tool-call-parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (Hermes 2/3, Qwen2.5, Qwen3, QwQ, and the bundled tiny model's
  template);
- ``llama3_json``: a JSON object ``{"name": ..., "parameters": {...}}`` (or
  several joined by ``;``), maybe after ``<|python_tag|>`` (Llama 3.1-3.3);
- ``pythonic``: a Python list of calls ``[f(a=1), g(b="x")]`` with literal
  arguments (Llama 3.2 and 4, and other models prompted that way).

Each parser reads a whole reply (`ToolParser.parse`) or a stream of text
deltas (`ToolParser.stream`): content is passed on as it comes, except the
few characters that may open a call; a call is reported once its text is
complete. A call whose JSON does not parse is left in the content, so no text
is ever lost.
"""

from __future__ import annotations

import abc
import ast
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncllm.errors import ConfigError, InvalidRequestError

__all__ = ["ToolCall", "ParsedReply", "ToolParser", "ToolCallStream", "TOOL_PARSERS", "get_tool_parser",
           "check_tools", "tool_call_id", "partial_tag_suffix",
           "call_from_value"]


def tool_call_id() -> str:
    """A fresh id for one call (``call_`` and 24 hex digits, as OpenAI's)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One call of a tool: its name, and its arguments as a JSON object's text (as OpenAI sends them)."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    """A reply split into its text content (None when there is none) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


def check_tools(tools: object) -> None:
    """`InvalidRequestError` unless `tools` is None or a list of OpenAI function tools.

    A tool is ``{"type": "function", "function": {"name": str, "description": str,
    "parameters": {JSON schema}}}`` (description and parameters optional).
    """
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", f"must be a list of tools, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequestError("tools", f"item {i} must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError("tools", f"item {i}: function needs a non-empty str 'name'")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidRequestError("tools", f"item {i}: function 'parameters' must be a JSON schema object")


class ToolCallStream(abc.ABC):
    """One reply's deltas in, content deltas and finished calls out (see `ToolParser.stream`)."""

    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content this delta releases, and the calls it completes."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the reply's end: whatever was held back (an unfinished call's text is content)."""


class ToolParser(abc.ABC):
    """A format of tool calls in a model's text."""

    needs_special_tokens = False
    """Its calls start with a special token (Mistral's ``[TOOL_CALLS]``): the server keeps special tokens in the
    reply's text (``skip_special_tokens`` false) for requests it reads, as vLLM does."""

    @abc.abstractmethod
    def stream(self) -> ToolCallStream:
        """A parser of one reply's deltas."""

    def parse(self, text: str) -> ParsedReply:
        """A whole reply's content and calls."""
        stream = self.stream()
        content, calls = stream.feed(text)
        tail, more = stream.finish()
        content += tail
        calls += more
        if calls:
            content = content.strip()
        return ParsedReply(content or None, calls)


def _call_from_json(text: str, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from the text of ``{"name": str, <one of arguments_keys>: {...}}``; None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return call_from_value(value, arguments_keys)


def call_from_value(value: object, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from ``{"name": str, <one of arguments_keys>: {...}}``; None when `value` is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class _HermesStream(ToolCallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(self.CLOSE):]
                self._in_call = False
                call = _call_from_json(block.strip(), ("arguments",))
                if call is None:
                    content.append(self.OPEN + block + self.CLOSE)  # not a call after all: keep its text
                else:
                    calls.append(call)
                    self._calls += 1
                continue
            start = self._buffer.find(self.OPEN)
            if start < 0:
                keep = partial_tag_suffix(self._buffer, self.OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(self.OPEN):]
            self._in_call = True
        return self._content("".join(content)), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest = (self.OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return self._content(rest), []

    def _content(self, text: str) -> str:
        """Text between calls that is only whitespace (the newlines around blocks) is not content."""
        return "" if self._calls and not text.strip() else text


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the next delta may complete it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call."""

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _WholeReplyStream(ToolCallStream):
    """A reply that opens with one of `openers` is calls, read whole at its end; any other reply is content."""

    def __init__(self, openers: tuple[str, ...], parse: Callable[[str], list[ToolCall] | None]) -> None:
        self._openers = openers
        self._parse = parse
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "content" or "calls"

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "content":
            return text, []
        self._buffer += text
        if self._mode == "calls":
            return "", []  # read whole at the end
        head = self._buffer.lstrip()
        if not head or any(opener.startswith(head) for opener in self._openers):
            return "", []  # whitespace, or an opener's first characters: not decided yet
        self._mode = "calls" if head.startswith(self._openers) else "content"
        if self._mode == "calls":
            return "", []
        text, self._buffer = self._buffer, ""
        return text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buffer = self._buffer, ""
        calls = self._parse(text.strip()) if self._mode == "calls" else None
        return ("", calls) if calls else (text, [])


_PYTHON_TAG = "<|python_tag|>"


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """Calls from ``{...}; {...}`` (maybe after ``<|python_tag|>``); None when any part is not a call."""
    text = text.removeprefix(_PYTHON_TAG)
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = call_from_value(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return calls or None


class Llama3JsonToolParser(ToolParser):
    """``{"name": "f", "parameters": {...}}`` (``; `` between several), maybe after ``<|python_tag|>``."""

    def stream(self) -> ToolCallStream:
        return _WholeReplyStream(("{", _PYTHON_TAG), _llama3_calls)


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """Calls from a Python list of calls with literal keyword arguments: ``[f(a=1), g(b="x")]``."""
    text = text.removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(arguments) != len(node.keywords):
            return None  # **kwargs
        calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


class PythonicToolParser(ToolParser):
    """``[get_weather(city="Paris"), add(a=1, b=2)]``: a Python list of calls (Llama 3.2 / 4 and others)."""

    def stream(self) -> ToolCallStream:
        return _WholeReplyStream(("[", "<|python_start|>"), _pythonic_calls)


_MISTRAL_TAG, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _mistral_calls(text: str) -> list[ToolCall] | None:
    """Calls after ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` (Mistral's tokenizers before v11) or
    ``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (v11 and later); None when not calls."""
    body = text.removeprefix(_MISTRAL_TAG).strip()
    if body.startswith("["):
        try:
            values = json.loads(body)
        except ValueError:
            return None
        calls = [call_from_value(value, ("arguments",)) for value in values] if isinstance(values, list) else []
        return None if not calls or None in calls else calls  # type: ignore[return-value]
    calls = []
    for part in body.split(_MISTRAL_TAG):
        name, sep, arguments = part.partition(_MISTRAL_ARGS)
        try:
            value = json.loads(arguments) if sep and name.strip() else None
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        calls.append(ToolCall(name.strip(), json.dumps(value, ensure_ascii=False)))
    return calls


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": "f", "arguments": {...}}]`` or ``[TOOL_CALLS]f[ARGS]{...}`` (Mistral, Mixtral,
    Ministral, Devstral); ``[TOOL_CALLS]`` is a special token, so the server keeps special tokens for it."""

    needs_special_tokens = True

    def stream(self) -> ToolCallStream:
        return _WholeReplyStream((_MISTRAL_TAG,), _mistral_calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "pythonic": PythonicToolParser,
    "mistral": MistralToolParser,
}
"""Parser name (vLLM's ``--tool-call-parser`` names) -> parser."""


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`; a `ConfigError` naming the known ones otherwise."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ConfigError("tool_call_parser", name, f"one of {sorted(TOOL_PARSERS)}")
    return parser()
