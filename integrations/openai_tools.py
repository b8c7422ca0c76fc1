"""Tool calling in chat completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``, as vLLM's server does it.

- ``"none"``: the tools are rendered into the prompt, the reply is text.
- ``"auto"`` (the default when tools are given): the model decides; the
  server's tool parser (``asyncllm serve --enable-auto-tool-choice
  --tool-call-parser hermes``) finds the calls in its text. Without a parser
  the request is a 400, as in vLLM.
- a named function (``{"type": "function", "function": {"name": ...}}``):
  the output is constrained to a JSON object of its parameters' schema and
  returned as that function's call (finish_reason "stop", as OpenAI).
- ``"required"``: the output is constrained to a JSON list of one or more
  ``{"name", "parameters"}`` calls (finish_reason "tool_calls").

`ToolReply` turns one choice's text deltas into OpenAI chat deltas (content
and ``tool_calls`` items); a non-streaming message is the merge of the same
deltas, so both forms always agree. Streaming, a named call's arguments flow
as the tokens come; an ``auto`` or ``required`` call is sent whole once its
text is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import StructuredOutputs
from asyncllm.tool_calls import ToolCall, ToolCallStream, ToolParser, check_tools, tool_call_id

__all__ = ["ToolMode", "tool_mode", "ToolReply", "merge_deltas"]


@dataclass(frozen=True)
class ToolMode:
    """How one request's replies are read: kind "none", "auto", "named" or "required"."""

    kind: str
    function: str | None = None
    """The named function (kind "named")."""
    parser: ToolParser | None = None
    """The server's parser (kind "auto")."""
    parallel: bool = True
    """False: one call at most (``parallel_tool_calls: false``)."""
    constraint: StructuredOutputs | None = None
    """The output constraint of kinds "named" and "required"."""


def tool_mode(tools: list[Any] | None, tool_choice: Any, parallel: bool | None, parser: ToolParser | None) -> ToolMode:
    """The request's mode; an `InvalidRequestError` naming the field for a choice it cannot take."""
    check_tools(tools)
    parallel = parallel is not False
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolMode("none")
    if not tools:
        raise InvalidRequestError("tool_choice", f"{tool_choice!r} needs tools")
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if tool_choice == "auto":
        if parser is None:
            raise InvalidRequestError("tool_choice", '"auto" needs a server started with --enable-auto-tool-choice '
                                                     "and --tool-call-parser (or choose 'none', 'required' or a function)")
        return ToolMode("auto", parser=parser, parallel=parallel)
    if tool_choice == "required":
        return ToolMode("required", parallel=parallel, constraint=_required_schema(functions.values(), parallel))
    name = _named(tool_choice)
    if name not in functions:
        raise InvalidRequestError("tool_choice", f"names {name!r}, which is not among the tools {sorted(functions)}")
    return ToolMode("named", function=name, constraint=StructuredOutputs(json=_parameters(functions[name])))


def _named(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type") != "function" or not isinstance(function.get("name"), str):
        raise InvalidRequestError("tool_choice", "must be 'none', 'auto', 'required' or "
                                                 f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
    return function["name"]


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}


def _required_schema(functions: Any, parallel: bool) -> StructuredOutputs:
    """A JSON list of calls ``{"name": one of the functions, "parameters": its schema}``."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                              "parameters": _parameters(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


class ToolReply:
    """One choice's reply under a `ToolMode`: text deltas in, OpenAI chat deltas out."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self._stream: ToolCallStream | None = mode.parser.stream() if mode.parser is not None else None
        self._text: list[str] = []
        self._calls = 0
        self._named_id = tool_call_id()

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` (the next part of the reply) releases."""
        kind = self.mode.kind
        if not text:
            return []
        if kind == "none":
            return [{"content": text}]
        if kind == "named":
            first = self._calls == 0
            self._calls = 1
            function = {"name": self.mode.function, "arguments": text} if first else {"arguments": text}
            return [{"tool_calls": [{"index": 0, **({"id": self._named_id, "type": "function"} if first else {}),
                                     "function": function}]}]
        if kind == "required":
            self._text.append(text)
            return []
        assert self._stream is not None
        return self._deltas(*self._stream.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """At the reply's end: the held-back deltas, and the finish_reason to report."""
        kind = self.mode.kind
        if kind == "required":
            calls = _required_calls("".join(self._text))
            if calls is None:  # cut short (length) or not a list of calls: the text as it is
                return [{"content": "".join(self._text)}] if self._text else [], finish_reason
            deltas = self._deltas("", calls)
            return deltas, "tool_calls" if finish_reason == "stop" else finish_reason
        if kind == "auto":
            assert self._stream is not None
            deltas = self._deltas(*self._stream.finish())
            if self._calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            return deltas, finish_reason
        return [], finish_reason

    def _deltas(self, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        for call in calls:
            if self._calls and not self.mode.parallel:
                break  # parallel_tool_calls false: the first call only
            deltas.append({"tool_calls": [{"index": self._calls, **call.to_openai()}]})
            self._calls += 1
        return deltas


def _required_calls(text: str) -> list[ToolCall] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in value):
        return None
    return [ToolCall(v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False)) for v in value]


def merge_deltas(deltas: list[dict[str, Any]], tools: bool) -> dict[str, Any]:
    """The assistant message the deltas stream: content joined, each call's argument parts joined.

    Without tool calling the content is always a str (as before tools
    existed); with it, None when there is none (as OpenAI).
    """
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for item in delta.get("tool_calls", ()):
            if item["index"] == len(calls):
                calls.append({"id": item["id"], "type": "function",
                              "function": {"name": item["function"]["name"], "arguments": ""}})
            calls[item["index"]]["function"]["arguments"] += item["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not tools else None}
    if calls:
        message["tool_calls"] = calls
    return message
