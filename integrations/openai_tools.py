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

openai_reply.py turns replies into messages and deltas under a `ToolMode`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import StructuredOutputs
from asyncllm.tool_calls import ToolParser, check_tools, tool_call_id

__all__ = ["ToolMode", "template_tools", "tool_mode"]


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
    new_call_id: Callable[[], str] = tool_call_id
    """A fresh call id: the server's parser's (`ToolParser.new_call_id`: Mistral's 9 letters and digits) in any kind."""


def tool_mode(tools: list[Any] | None, tool_choice: Any, parallel: bool | None, parser: ToolParser | None) -> ToolMode:
    """The request's mode; an `InvalidRequestError` naming the field for a choice it cannot take."""
    check_tools(tools)
    parallel = parallel is not False
    ids = parser.new_call_id if parser is not None else tool_call_id
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none" or tools == [] and tool_choice in ("auto", "required"):  # [] calls none: OpenAI's, vLLM's
        return ToolMode("none")
    if not tools:
        raise InvalidRequestError("tool_choice", f"{tool_choice!r} needs tools")
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if tool_choice == "auto":
        if parser is None:
            raise InvalidRequestError("tool_choice", '"auto" needs a server started with --enable-auto-tool-choice '
                                                     "and --tool-call-parser (or choose 'none', 'required' or a function)")
        return ToolMode("auto", parser=parser.for_tools(functions), parallel=parallel, new_call_id=ids)
    if tool_choice == "required":
        return ToolMode("required", parallel=parallel, new_call_id=ids,  # each tool, two of one name too: vLLM's
                        constraint=_required_schema([tool["function"] for tool in tools], parallel))
    name = _named(tool_choice)
    if name not in functions:
        raise InvalidRequestError("tool_choice", f"names {name!r}, which is not among the tools {sorted(functions)}")
    return ToolMode("named", function=name, constraint=StructuredOutputs(json=_parameters(functions[name])),
                    new_call_id=ids)


def template_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Checked tools as vLLM's server hands them to the chat template (``ChatCompletionToolsParam(**tool)
    .model_dump()``): ``type`` ("function" when left out), then ``function``: ``name``, ``description`` and
    ``parameters`` first (None when left out), then the keys the client added, in its order. Templates that
    ``tojson`` a whole tool (Llama 3.1's, Qwen2.5's) so render vLLM's prompt."""
    check_tools(tools)
    return None if tools is None else [_dumped_tool(tool) for tool in tools]


def _dumped_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    declared = {"name": function["name"], "description": function.get("description"),
                "parameters": function.get("parameters")}
    extra = {key: value for key, value in tool.items() if key not in ("type", "function")}
    return {"type": "function", "function": {**declared, **function}, **extra}


def _named(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(function, dict) or tool_choice.get("type", "function") != "function"  # left out: vLLM's default
            or not isinstance(function.get("name"), str)):
        raise InvalidRequestError("tool_choice", "must be 'none', 'auto', 'required' or "
                                                 f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
    return function["name"]


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters schema; a function without (or with empty) ``parameters`` takes none: ``{}``, as
    vLLM constrains it (``{"type": "object"}`` alone would let the model write any object)."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def _required_schema(functions: Any, parallel: bool) -> StructuredOutputs:
    """A JSON list of calls ``{"name": one of the functions, "parameters": its schema}``; the functions' ``$defs``
    lifted to the list's root, where their ``#/$defs/...`` references resolve (vLLM's ``get_tool_schema_defs``)."""
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                              "parameters": _lifted_defs(f, defs)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputs(json=schema)


def _lifted_defs(function: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters without their ``$defs``, which join `defs`; a 400 on ``tools`` when two functions
    define one name differently, as vLLM."""
    parameters = dict(_parameters(function))
    own = parameters.pop("$defs", None) or {}
    if not isinstance(own, dict):
        raise InvalidRequestError("tools", f"function {function['name']!r}: parameters' $defs must be an object")
    for name, schema in own.items():
        if defs.setdefault(name, schema) != schema:
            raise InvalidRequestError("tools", f"tool definition {name!r} has multiple schemas, which is not supported")
    return parameters
