"""OpenAI's Responses API (``POST /v1/responses``), run through the chat machinery.

A request's ``input`` (a string, or message / ``reasoning`` / ``function_call`` /
``function_call_output`` items; messages with ``input_text`` and, for a
multimodal model, ``input_image`` parts) and ``instructions`` become chat messages
(merged into assistant turns as vLLM merges them: responses_input.py);
``tools`` (flat function tools, and a ``namespace`` tool's as ``<namespace>__<name>``, its calls named back with
their ``namespace``, as vLLM's; tools of other types, ``web_search``, ``local_shell``, ``custom``, ..., are left
out, as vLLM leaves them out of the template), ``tool_choice`` (``"auto"``, the default, is no tool calling on a
server without a tool-call parser, as vLLM's Responses API; OpenAI's other choice objects are ``"none"``:
`OTHER_TOOL_CHOICES`), ``reasoning.effort`` (the template's
``reasoning_effort``), ``text.format`` and the
sampling fields become a `ChatCompletionRequest`, so templates, tool calling,
reasoning parsers and structured output behave exactly as in chat
completions. The reply comes back as output items: ``reasoning`` (with a
reasoning parser), ``message`` (``output_text``) and ``function_call``, one
per harmony message for gpt-oss (as vLLM's); a streamed reply as the API's
semantic events (``response.created``, ..., ``response.output_text.delta``,
..., ``response.completed``). Both fold deltas alike (`ResponseEvents`): the same items but where chat's forms
differ (`ChatReply`): streamed, an ``auto`` call broken after its first piece is a ``function_call`` (as sent) then
a ``message`` (whole: the ``message`` only), and a ``llama3_json`` reply's text before its first call a ``message``.

``store`` and ``previous_response_id`` are resolved by the server's response
store (responses_store.py): `chat_request` runs the items it hands over
before ``input``. Not built, and refused by name (`check_request`): ``background``,
``include: ["message.output_text.logprobs"]`` (vLLM's other ``include`` values are accepted and ignored:
`INCLUDE_VALUES`), ``truncation: "auto"``, ``top_logprobs`` other than 0, ``max_tool_calls``, ``request_id``,
``prompt`` (stored prompt templates), ``conversation`` (conversation objects);
the hosted service's fields are chat's (openai_standard.py: ``prompt_cache_key``
is accepted and ignored, as vLLM ignores it), and so are ``reasoning.summary`` and Codex's ``client_metadata``.
The response echoes ``reasoning`` and ``service_tier`` (the request's, default ``auto``), as vLLM's.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.errors import renamed_fields
from asyncllm.integrations.openai_protocol import CacheSalt, ChatCompletionRequest
from asyncllm.integrations.openai_standard import (
    BaseStreamOptions, Metadata, check_service_fields, check_stream_options, refuse_failed,
)
from asyncllm.integrations.openai_structured import JSON_SCHEMA_KEYS
from asyncllm.integrations.responses_input import input_items, input_messages
from asyncllm.sampling import SamplingParams

__all__ = ["RESPONSES_FIELDS", "ResponsesRequest", "check_request", "chat_request", "input_items", "response_body",
           "response_identity", "responses_errors", "ResponseEvents"]


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/responses`` (OpenAI's fields, then vLLM's sampling extensions)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    """null is false (OpenAI's and vLLM's ``stream: bool | None``)."""
    stream_options: BaseStreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    """``{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict", "description"}}``."""
    store: bool | None = None
    """Keep the response (default: yes, as OpenAI) when the server's store is on (responses_store.py); else
    accepted and answered ``false``."""
    metadata: Metadata = None
    user: str | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    """vLLM's values (`INCLUDE_VALUES`), accepted and ignored (no output here has that data), but
    ``message.output_text.logprobs`` (not built)."""
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    """OpenAI's ``Reasoning``: ``effort`` reaches the chat template as ``reasoning_effort`` (as vLLM's); ``summary``
    and ``generate_summary`` are accepted and ignored (no summaries are written, as vLLM's), and so are other keys.
    Echoed."""
    service_tier: str | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int = 0
    cache_salt: CacheSalt = None
    chat_template_kwargs: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: dict[str, Any] | None = None
    top_logprobs: int | None = None
    """Only 0 (vLLM's default): logprobs in the output need ``include``, not built."""
    max_tool_calls: int | None = None
    request_id: str | None = None
    prompt_cache_key: str | None = None
    """Accepted and ignored, as vLLM ignores it (and ``safety_identifier``, as ``user``: openai_standard.py)."""
    safety_identifier: str | None = None
    prompt: dict[str, Any] | None = None
    """OpenAI's stored prompt template (``{"id", "version", "variables"}``): not built."""
    conversation: str | dict[str, Any] | None = None
    """OpenAI's conversation object: not built (``previous_response_id`` continues a response)."""
    client_metadata: dict[str, str] | None = None
    """Codex's (sent with its trace context): accepted and ignored, as vLLM ignores fields it does not know."""


_PASSED_THROUGH = ("seed", "top_k", "min_p", "repetition_penalty", "priority", "cache_salt", "chat_template_kwargs",
                   "user", "stream", "stop", "logit_bias", "ignore_eos", "skip_special_tokens",
                   "include_stop_str_in_output", "structured_outputs")
"""The fields a chat completion has under the same name (vLLM's sampling extensions among them)."""

RESPONSES_FIELDS = {"messages": "input", "prompt": "input", "response_format": "text.format",
                    "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}
"""The chat request's fields (`chat_request`) that errors name -> the Responses API's (`renamed_fields`): ``prompt``,
the engine's name of the rendered messages (a prompt over the context, `check_context_length`), is the input too."""


@contextlib.contextmanager
def responses_errors() -> Iterator[None]:
    """The chat's errors worded for the Responses API: fields renamed (`RESPONSES_FIELDS`), and chat's
    ``response_format`` in a message (one naming another field: ``structured_outputs``, ``tool_choice``) written as the
    client's ``text.format``."""
    try:
        with renamed_fields(RESPONSES_FIELDS):
            yield
    except InvalidRequestError as exc:
        if "response_format" not in exc.message:
            raise
        raise InvalidRequestError(exc.field, re.sub(r"\bresponse_format\b", "text.format", exc.message),
                                  code=exc.code) from None


INCLUDE_VALUES = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
                  "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content")
"""vLLM's ``include`` values (its ``ResponsesRequest``'s literal); another is a 400 naming ``include``."""

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
"""OpenAI's ``Reasoning.effort`` and ``summary`` (and ``generate_summary``) values, as vLLM validates them."""


def check_request(req: ResponsesRequest) -> None:
    """The fields not built (a 400 naming each), checked before the request is looked up or run
    (`ResponseStore.begin`), so that errors name the Responses API's fields as sent (``prompt`` is not ``input``)."""
    include = req.include or []
    unknown = [value for value in include if value not in INCLUDE_VALUES]
    reasoning = req.reasoning or {}
    refuse_failed([
        (bool(req.background), "background", "background responses are not built"),
        (bool(unknown), "include", f"{unknown[0]!r} is not one of {', '.join(INCLUDE_VALUES)}" if unknown else ""),
        ("message.output_text.logprobs" in include, "include",
         "'message.output_text.logprobs': logprobs in the output are not built"),
        (req.truncation not in (None, "disabled"), "truncation", "only 'disabled' is built"),
        (reasoning.get("effort") not in (None, *REASONING_EFFORTS), "reasoning.effort",
         f"must be one of {', '.join(REASONING_EFFORTS)} or null, got {reasoning.get('effort')!r}"),
        *((reasoning.get(key) not in (None, *REASONING_SUMMARIES), f"reasoning.{key}",
           f"must be one of {', '.join(REASONING_SUMMARIES)} or null, got {reasoning.get(key)!r}")
          for key in ("summary", "generate_summary")),
        (bool(req.top_logprobs), "top_logprobs", "logprobs in the output are not built (only 0)"),
        (req.max_tool_calls is not None, "max_tool_calls", "limiting tool calls is not built"),
        (req.request_id is not None, "request_id", "a client's response id is not built"),
        (req.prompt is not None, "prompt", "stored prompt templates are not built (send the input)"),
        (req.conversation is not None, "conversation",
         "conversation objects are not built (continue a response with previous_response_id)"),
        (_verbosity(req.text) not in (None, "low", "medium", "high"), "text.verbosity",
         f"must be 'low', 'medium', 'high' or null, got {_verbosity(req.text)!r}"),
    ])
    check_stream_options(req.stream_options, req.stream)
    check_service_fields(req)


def _verbosity(text: dict[str, Any] | None) -> Any:
    """``text.verbosity`` (OpenAI's ``ResponseTextConfig``: low, medium, high; accepted and not read)."""
    return (text or {}).get("verbosity")


def chat_request(req: ResponsesRequest, history: Sequence[dict[str, Any]] | None = None,
                 auto_tools: bool = True) -> ChatCompletionRequest:
    """The chat completion that runs this response (every check of chat completions applies; the Responses API's
    own are `check_request`'s).

    `history`: the conversation before ``input`` that ``previous_response_id``
    names (input items, as the response store hands them over); without it a
    ``previous_response_id`` is refused. `auto_tools`: whether the server reads replies for tool calls (a tool-call
    parser); without one, ``tool_choice: "auto"`` (the default) is served as ``"none"``, the tools still in the
    template, as vLLM's Responses API serves it (chat completions refuse it).
    """
    if req.previous_response_id is not None and history is None:
        raise InvalidRequestError("previous_response_id", "continuing a response needs the server's response store")
    items = [*history, *input_items(req.input)] if history else req.input
    tools = _chat_tools(req.tools)
    fields: dict[str, Any] = {
        "model": req.model, "messages": input_messages(items, req.instructions),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": tools, "tool_choice": _chat_tool_choice(req.tool_choice, tools, auto_tools, req.tools),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
        "reasoning_effort": (req.reasoning or {}).get("effort"),
        **{name: getattr(req, name) for name in _PASSED_THROUGH},
    }
    return msgspec.convert({k: v for k, v in fields.items() if v is not None}, ChatCompletionRequest)


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools ``{"type", "name", "parameters", ...}`` in the chat shape; the hosted and
    client-side tools of other types (``web_search``, ``local_shell``, ``custom``, ``mcp``, ...) are left out, as
    vLLM leaves them out of the template (it runs none of them without its tool server). None: no function tools."""
    out = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise InvalidRequestError("tools", f"item {i}: a tool must be an object with a string type, got {tool!r}")
        for name, function in _functions(tool):
            declared = {k: function[k] for k in ("description", "parameters") if function.get(k) is not None}
            out.append({"type": "function", "function": {**({"name": name} if name is not None else {}), **declared}})
    return out or None


NAMESPACE_SEPARATOR = "__"
"""vLLM's: a ``namespace`` tool's function ``f`` of namespace ``ns`` reaches the template as ``ns__f``."""


def _functions(tool: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
    """A tool's functions as (the template's name, the function): a function tool's own; a ``namespace`` tool's
    function tools (Codex's MCP tools), flattened as vLLM's ``iter_response_function_tool_dicts``; none of another
    type."""
    if tool["type"] == "function":
        return [(tool.get("name"), tool)]
    if tool["type"] != "namespace":
        return []
    inner = tool.get("tools")
    if not isinstance(tool.get("name"), str) or not isinstance(inner, list) or not all(
            isinstance(each, dict) and isinstance(each.get("name"), str) for each in inner):
        raise InvalidRequestError("tools", "a namespace tool needs a string name and a list of tools with string "
                                           f"names, got {tool!r}")
    return [(f"{tool['name']}{NAMESPACE_SEPARATOR}{each['name']}", each) for each in inner
            if each.get("type") == "function"]


def namespaced_calls(tools: list[dict[str, Any]] | None) -> dict[str, tuple[str, str]]:
    """The template's name of each namespaced function -> (its namespace, its name), to write calls back as the
    client named them (vLLM's ``build_responses_tool_call_name_map``)."""
    return {f"{tool['name']}{NAMESPACE_SEPARATOR}{inner['name']}": (tool["name"], inner["name"])
            for tool in tools or () if isinstance(tool, dict) and tool.get("type") == "namespace"
            for inner in tool.get("tools") or () if isinstance(inner, dict) and inner.get("type") == "function"}


OTHER_TOOL_CHOICES = {
    "allowed_tools": ("mode", "tools"), "custom": ("name",), "mcp": ("server_label",), "shell": (),
    "apply_patch": (), "file_search": (), "web_search_preview": (), "web_search_preview_2025_03_11": (),
    "computer": (), "computer_use": (), "computer_use_preview": (), "image_generation": (), "code_interpreter": ()}
"""OpenAI's ``tool_choice`` objects other than a function's (openai's ``ToolChoice``, which vLLM's request takes): each
type's required keys. vLLM parses calls for none of them (``_parse_tool_calls``: ``auto``, ``required`` and a
function only), so they are served as ``"none"``: the tools in the template, the reply text."""


def _chat_tool_choice(choice: Any, tools: list[Any] | None, auto_tools: bool = True,
                      sent_tools: list[Any] | None = None) -> Any:
    """The choice as chat's; ``"auto"`` (the Responses API's default) without function tools is no tool calling, as
    OpenAI's and vLLM's, where chat refuses it, and so is it on a server that does not read replies for calls
    (`auto_tools` false), as vLLM's Responses API, and so is any of `OTHER_TOOL_CHOICES`. A forced function may name a
    ``namespace`` tool's function by its own name (with or without ``namespace``). `sent_tools`: the request's own
    (`tools` are the chat's)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice in (None, "auto") and (not tools or not auto_tools) or _other_tool_choice(choice, kind):
        return "none" if tools else None
    if choice == "required" and not tools:
        raise InvalidRequestError("tool_choice", "'required' needs function tools, and the request has none" + (
            " (its tools of other types are not run by this server)" if sent_tools else ""))
    if kind == "function" and isinstance(choice.get("name"), str):
        if not tools:
            raise InvalidRequestError("tool_choice", f"names {choice['name']!r}, but the request has no tools")
        return {"type": "function", "function": {"name": _forced_name(choice, tools, sent_tools)}}
    if choice not in (None, "auto", "none", "required"):  # worded with the Responses API's shape
        raise InvalidRequestError("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', "
                                                 f"'name': ...}}, got {choice!r}")
    return choice


def _other_tool_choice(choice: Any, kind: Any) -> bool:
    """Whether `choice` is one of `OTHER_TOOL_CHOICES`, its required keys there (``allowed_tools``' mode ``auto`` or
    ``required``, its tools a list)."""
    if kind not in OTHER_TOOL_CHOICES or any(choice.get(key) is None for key in OTHER_TOOL_CHOICES[kind]):
        return False
    return kind != "allowed_tools" or choice["mode"] in ("auto", "required") and isinstance(choice["tools"], list)


def _forced_name(choice: dict[str, Any], tools: list[Any], sent_tools: list[Any] | None) -> str:
    """The template's name of a forced function: its ``name``; ``<namespace>__<name>`` with a ``namespace``, or where
    ``name`` is no flat tool's but one ``namespace`` tool's function's (the name its client knows it by)."""
    name, namespace = choice["name"], choice.get("namespace")
    if isinstance(namespace, str):
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    nested = [full for full, (_, short) in namespaced_calls(sent_tools).items() if short == name]
    flat = any(tool["function"].get("name") == name for tool in tools)
    return nested[0] if not flat and len(nested) == 1 else name


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (a json_schema's name, schema, strict and description in its
    ``json_schema``); a key OpenAI's format of that type does not have is a 400 naming ``text.format.<key>``."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequestError("text.format", f"must be an object ({{\"type\": ...}}), got {fmt!r}")
    kind = None if fmt is None else fmt.get("type")
    if kind not in (None, "text", "json_object", "json_schema"):
        raise InvalidRequestError("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    known = {"type", *JSON_SCHEMA_KEYS} if kind == "json_schema" else {"type"}
    unknown = [key for key in fmt or () if key not in known]
    if unknown:
        raise InvalidRequestError(f"text.format.{unknown[0]}", f"unknown field (OpenAI's {kind or 'text'} format has "
                                                               f"{', '.join(sorted(known))})")
    if fmt is None or kind in (None, "text"):
        return None
    if kind == "json_schema":
        _check_json_schema(fmt)
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return {"type": kind}


def _check_json_schema(fmt: dict[str, Any]) -> None:
    """A json_schema format's ``name`` and ``schema`` (both required, as in OpenAI's
    ``ResponseFormatTextJSONSchemaConfig``), refused naming ``text.format.<key>`` (chat's check would name its
    ``json_schema`` object, which this API has not)."""
    if not isinstance(fmt.get("name"), str):
        raise InvalidRequestError("text.format.name", f"a json_schema format needs a string name, got "
                                                      f"{fmt.get('name')!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequestError("text.format.schema", f"a json_schema format needs a JSON schema object, got "
                                                        f"{type(fmt.get('schema')).__name__}")


# ------------------------------------------------------------------ the response
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_identity() -> tuple[str, int]:
    """A response's id and ``created_at``, taken when its request arrives (vLLM's ``created_time``)."""
    return _new_id("resp"), int(time.time())


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Responses' usage of a chat's, whose prompt_tokens_details the server asks for with the flag or not
    (`OpenAIServer.responses`: vLLM's Responses API counts cached input tokens always) and its
    completion_tokens_details (`Choices.reasoning_tokens`); 0 where a usage has none. ``cache_write_tokens`` (openai's
    ``InputTokensDetails``) is 0: OpenAI counts the writes of explicit cache breakpoints, and the prefix cache here is
    implicit (as OpenAI's default caching, which reports none)."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    details = {"cached_tokens": cached, "cache_write_tokens": 0}  # the prefix cache is implicit: no paid writes
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": details,
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}


def _text_echo(text: dict[str, Any] | None) -> dict[str, Any]:
    """The response's ``text``: the request's, with OpenAI's default format (``text``) where it sets none (a
    ``verbosity`` alone, or a null format)."""
    return {**(text or {}), "format": (text or {}).get("format") or {"type": "text"}}


def _sampled(req: ResponsesRequest, params: SamplingParams | None) -> dict[str, Any]:
    """``temperature``, ``top_p`` and ``max_output_tokens`` as the reply was sampled with (vLLM's echo of its
    ``sampling_params``): the request's, else the model's generation-config defaults, else 1.0 and 1.0, as OpenAI's
    response reports them; ``max_output_tokens`` null where nothing bounds the reply but the context (OpenAI's null;
    vLLM's echoes the room left, max_model_len - the prompt). Without `params` (a body built outside the server), the
    request's values over OpenAI's defaults."""
    if params is None:
        params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, max_tokens=req.max_output_tokens)
    return {"temperature": params.temperature, "top_p": params.top_p, "max_output_tokens": params.max_tokens}


def _skeleton(req: ResponsesRequest, response_id: str, created: int, model: str,
              params: SamplingParams | None = None) -> dict[str, Any]:
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model, "status": "in_progress",
        "output": [], "error": None, "incomplete_details": None, "instructions": req.instructions,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
        **_sampled(req, params), "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "text": _text_echo(req.text), "store": req.store is True,
        "previous_response_id": req.previous_response_id, "truncation": "disabled", "usage": None,
        "background": False, "max_tool_calls": None, "top_logprobs": 0, "user": req.user,  # as OpenAI's and vLLM's
        "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        "reasoning": req.reasoning, "service_tier": req.service_tier or "auto",  # the request's, as vLLM echoes them
    }


_FINISHED_STATUSES: dict[str | None, tuple[str, dict[str, str] | None]] = {
    "length": ("incomplete", {"reason": "max_output_tokens"}),
    "abort": ("cancelled", None),  # aborted in the engine (`AsyncEngine.abort`, a drain's end): vLLM's "cancelled"
}
"""A chat finish_reason -> the response's ``status`` and ``incomplete_details``; any other: ``completed``."""


def _finished(body: dict[str, Any], finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    status, details = _FINISHED_STATUSES.get(finish_reason, ("completed", None))
    return {**body, "status": status, "usage": _usage(usage), "incomplete_details": details}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if text or status == "completed" else []}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call: dict[str, Any], status: str,
               namespaces: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """A ``function_call`` item; a namespaced function's call with its ``namespace`` and own name (vLLM's)."""
    name = call["function"]["name"]
    namespace, name = (namespaces or {}).get(name, (None, name))
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": name,
            "arguments": call["function"]["arguments"], "status": status,
            **({"namespace": namespace} if namespace is not None else {})}


def response_body(req: ResponsesRequest, model: str, deltas: list[dict[str, Any]], finish_reason: str | None,
                  usage: dict[str, Any], identity: tuple[str, int] | None = None,
                  params: SamplingParams | None = None) -> dict[str, Any]:
    """A whole response from a chat choice's deltas (`Choices.reply_deltas`): the body its stream would end with
    (`ResponseEvents`), so a response has the same output items streamed or not; `params`: the sampling parameters
    the chat ran with (`Choices.sampling`), echoed."""
    events = ResponseEvents(req, model, identity, params=params)
    events.feed(deltas)
    events.finish(finish_reason, usage)
    return events.body


class ResponseEvents:
    """A streamed response: chat deltas (openai_reply.py) in, the API's SSE events out.

    Items open as the deltas go: a ``reasoning`` item for reasoning, a ``message`` for content, a
    ``function_call`` per call; a change of kind, or a ``message_start`` delta (a harmony message's,
    `ChatReply`'s ``message_starts``), closes the open text item, so a gpt-oss reply has an item per message."""

    def __init__(self, req: ResponsesRequest, model: str, identity: tuple[str, int] | None = None,
                 on_finish: Callable[[dict[str, Any]], Any] | None = None,
                 params: SamplingParams | None = None) -> None:
        self.body = _skeleton(req, *(identity or response_identity()), model, params)
        self._on_finish = on_finish
        """Called with the finished body before the last event (the response store keeps it)."""
        self._sequence = 0
        self._open: dict[str, Any] | None = None
        """The output item being streamed: {"kind", "id", "index", "text" or "call"}."""
        self._output: list[dict[str, Any]] = []
        self._namespaces = namespaced_calls(req.tools)

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.body),
                self._event("response.in_progress", response=self.body)]

    def feed(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        events: list[bytes] = []
        for delta in deltas:
            if delta.get("message_start") and self._open is not None and self._open["kind"] != "call":
                events += self._close()
            if "reasoning" in delta:
                events += self._text_delta("reasoning", delta["reasoning"])
            elif "content" in delta:
                events += self._text_delta("message", delta["content"])
            for item in delta.get("tool_calls", ()):
                events += self._call_delta(item)
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.body = {**_finished(self.body, finish_reason, usage), "output": self._output}
        if self._on_finish is not None:
            self._on_finish(self.body)
        # OpenAI's stream has no event of a cancelled response: vLLM's ends with response.completed whatever the status
        kind = "response.incomplete" if self.body["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.body)]

    def error(self, error: dict[str, Any]) -> bytes:
        """An ``error`` event (an engine error after the stream began), OpenAI's and vLLM's ``ResponseErrorEvent``:
        the error body's code, message and param (its own ``type`` is not the event's); the stream ends there."""
        return self._event("error", code=error["code"], message=error["message"], param=error["param"])

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        events = self._switch(kind)
        assert self._open is not None
        self._open["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._event(name, item_id=self._open["id"], output_index=self._open["index"],
                                     content_index=0, delta=text, **extra)]

    def _call_delta(self, item: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if "id" in item:  # a new call
            events = self._close()
            call = {"id": item["id"], "function": {"name": item["function"]["name"], "arguments": ""}}
            self._open = {"kind": "call", "id": _new_id("fc"), "index": len(self._output), "call": call}
            events.append(self._event("response.output_item.added", output_index=self._open["index"],
                                      item=_call_item(self._open["id"], call, "in_progress", self._namespaces)))
        assert self._open is not None and self._open["kind"] == "call"
        arguments = item["function"].get("arguments", "")
        self._open["call"]["function"]["arguments"] += arguments
        return events + [self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                     output_index=self._open["index"], delta=arguments)]

    def _switch(self, kind: str) -> list[bytes]:
        """Open an item of `kind` unless one is open (closing another kind first)."""
        if self._open is not None and self._open["kind"] == kind:
            return []
        events = self._close()
        self._open = {"kind": kind, "id": _new_id("rs" if kind == "reasoning" else "msg"), "index": len(self._output),
                      "text": ""}
        index, item_id = self._open["index"], self._open["id"]
        if kind == "reasoning":  # vLLM's reasoning_part events around the reasoning_text ones
            return events + [self._event("response.output_item.added", output_index=index,
                                         item=_reasoning_item(item_id, "")),
                             self._event("response.reasoning_part.added", item_id=item_id, output_index=index,
                                         content_index=0, part={"type": "reasoning_text", "text": ""})]
        part = {"type": "output_text", "text": "", "annotations": []}
        return events + [self._event("response.output_item.added", output_index=index,
                                     item=_message_item(item_id, "", "in_progress")),
                         self._event("response.content_part.added", item_id=item_id, output_index=index,
                                     content_index=0, part=part)]

    def _close(self) -> list[bytes]:
        open_, self._open = self._open, None
        if open_ is None:
            return []
        index, item_id = open_["index"], open_["id"]
        if open_["kind"] == "call":
            item = _call_item(item_id, open_["call"], "completed", self._namespaces)
            events = [self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                  arguments=item["arguments"])]
        elif open_["kind"] == "reasoning":
            item = _reasoning_item(item_id, open_["text"])
            events = [self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                  content_index=0, text=open_["text"]),
                      self._event("response.reasoning_part.done", item_id=item_id, output_index=index,
                                  content_index=0, part=item["content"][0])]
        else:
            item = _message_item(item_id, open_["text"], "completed")
            events = [self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                  text=open_["text"], logprobs=[]),
                      self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                  part=item["content"][0])]
        self._output.append(item)
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"
