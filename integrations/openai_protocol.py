"""OpenAI request bodies as msgspec Structs, and the request-level helpers the handlers share.

Unknown fields are refused with a 400 naming them (OpenAI does the same), so a client never believes an option took
effect when asyncllm does not build it (OpenAI's ``stream_options`` and hosted service's fields: openai_standard.py).
vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``, ``prompt_logprobs``, ``priority``, ``cache_salt``,
``chat_template``, ...) are accepted, as a vLLM user expects, and
so are vLLM's ``use_beam_search`` (openai_beam_search.py runs it) and structured output: OpenAI's
``response_format`` (``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``). Tool calling (``tools``, ``tool_choice``) is read in openai_tools.py.
openai_sampling.py maps the bodies to `SamplingParams` and refuses the options not built yet (``suffix``,
``best_of`` != n, ...) by name.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

import msgspec

from asyncllm.config_checks import check_int, is_int
from asyncllm.engine.validation import check_request_id
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.integrations.openai_standard import Metadata, StreamOptions, Verbosity

__all__ = [
    "ServerLimits", "StreamOptions", "CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
    "decode_request", "completion_prompts", "request_options", "take_request_id", "header_data_parallel_rank",
    "template_kwargs", "chat_echo", "chat_role", "response_id", "ChatTemplates"]


@dataclass(frozen=True)
class ServerLimits:
    """Per-request bounds the server enforces before anything reaches the engine; each at least 1 (`ConfigError`)."""

    max_body_bytes: int = 64 << 20
    """Largest request body (413 beyond): a bound against abuse that still takes a few photos as data URLs."""
    max_audio_bytes: int = 25 << 20
    """Largest upload to ``/v1/audio/transcriptions`` and ``/translations`` (413 beyond; OpenAI's 25 MB)."""
    max_n: int = 128
    """Largest `n` (samples per prompt, a beam search's width): RL rollouts' 64, 128 fit (vLLM: none; engine: 1024)."""
    max_tokens: int | None = None
    """Largest `max_tokens`; None = the model's max_model_len bounds it."""
    max_prompts: int = 2048
    """Most prompts in a /v1/completions request, or inputs in a /v1/embeddings one (OpenAI's limit; vLLM: none)."""
    allowed_local_media_path: Path | None = None
    """The folder whose files requests may name as ``file://`` media urls (vLLM's ``--allowed-local-media-path``:
    a risk, for trusted clients only); None: no file is read for a request (`media_url`). Resolved at creation."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_audio_bytes", "max_n", "max_tokens", "max_prompts"):  # 0 refuses all
            check_int(name, getattr(self, name), 1, optional=name == "max_tokens")
        root = self.allowed_local_media_path
        if root is not None and not Path(root).is_dir():
            raise ConfigError("allowed_local_media_path", str(root), "an existing folder")
        object.__setattr__(self, "allowed_local_media_path", None if root is None else Path(root).resolve())

    def check_sequences(self, prompts: int, n: int, field: str = "n") -> None:
        """`InvalidRequestError` naming `field` when prompts x n exceed max(max_prompts, max_n): no product."""
        most = max(self.max_prompts, self.max_n)
        if prompts * n > most:
            raise InvalidRequestError(field, f"{prompts} prompts x {n} = {prompts * n} sequences (at most {most})")


T = TypeVar("T")
_NULL_IS_DEFAULT, _BOOL_IS_COUNT = object(), object()
Nullable = Annotated[T | None, _NULL_IS_DEFAULT]
"""A field vLLM declares ``X | None = default`` where null means the default (its ``SamplingParams.from_optional``
and handlers read None so): JSON null decodes to the field's default (`_Request`). A wrong type is still a 400
naming the field."""
LaxCount = Annotated[int | bool | None, _BOOL_IS_COUNT]
CacheSalt = Annotated[str, msgspec.Meta(min_length=1)] | None
"""vLLM's ``cache_salt``: a non-empty string if given (its server refuses ""; the engine API takes "" as a salt)."""
"""A logprob count (vLLM's ``int | None``): JSON true is 1 and false 0, as vLLM's pydantic reads them (lax mode)."""


@functools.cache
def _marked(cls: type[msgspec.Struct], marker: object) -> tuple[tuple[str, Any], ...]:
    """The fields of `cls` annotated with `marker` (`Nullable`, `LaxCount`) and their defaults."""
    return tuple((f.name, f.default) for f in msgspec.structs.fields(cls)
                 if get_origin(f.type) is Annotated and marker in get_args(f.type)[1:])


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request body: `Nullable` fields sent as null take their defaults, `LaxCount` fields sent as a bool 1 or 0."""

    def __post_init__(self) -> None:
        for name, default in _marked(type(self), _NULL_IS_DEFAULT):
            if getattr(self, name) is None:
                setattr(self, name, default)
        for name, _ in _marked(type(self), _BOOL_IS_COUNT):
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))


class _Common(_Request, kw_only=True, forbid_unknown_fields=True):
    """Fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    """The served model's name; left out, the served model (as vLLM's server)."""
    n: int = 1
    """Not nullable for completions (vLLM's ``n: int = 1``); chat's is."""
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: Nullable[bool] = False
    stream_options: StreamOptions | None = None
    presence_penalty: Nullable[float] = 0.0
    frequency_penalty: Nullable[float] = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    """End-user id for the caller's own abuse tracking; accepted and not used by asyncllm."""
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprobs' tokens as ``token_id:N``; None: the server's --return-tokens-as-token-ids."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: cut the prompt to k tokens (-1: as many as max_model_len allows): token ids keep their last k, a
    text prompt is cut by the tokenizer on the left, its special tokens kept (BOS, then the text's last tokens)."""
    prompt_logprobs: LaxCount = None
    """vLLM's: each prompt token's logprob and the N most likely there (not with stream, but for 0)."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    """OpenAI's: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", ...}}``."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (EBNF or Lark), ``json_object: true``."""
    priority: int = 0
    """vLLM's: lower runs first; needs an engine started with scheduling_policy='priority' unless 0."""
    cache_salt: CacheSalt = None
    """vLLM's: requests with different salts never share prefix-cached KV."""
    use_beam_search: bool = False
    """vLLM's: beam search of width n (completions: best_of when given) instead of sampling (openai_beam_search.py)."""
    length_penalty: float = 1.0
    """vLLM's, with use_beam_search: beams are ranked by cumulative logprob / length ** length_penalty."""
    request_id: str | None = None
    """vLLM's: the response's id is ``cmpl-`` / ``chatcmpl-`` and this (by default a random one)."""
    return_token_ids: Nullable[bool] = False
    """vLLM's: each choice carries its ``token_ids``, and the prompt's ``prompt_token_ids`` (streamed: each chunk's
    choice the ids it adds; a completion choice's first chunk, a chat's first chunks at the top, the prompt's)."""
    spaces_between_special_tokens: bool = True
    """vLLM's: false (with skip_special_tokens false) joins adjacent added tokens without the decoder's space."""
    add_special_tokens: bool | None = None
    """vLLM's: tokenize the prompt with the tokenizer's special tokens (BOS); default true for completions, false
    for chat (whose template writes them); a prompt with media takes only the default."""


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[Any] | None = None
    """A string, a list of strings, a list of token ids, or a list of token-id lists (or `prompt_embeds`)."""
    prompt_embeds: str | list[str] | None = None
    """vLLM's: base64 ``torch.save``'d ``[tokens, hidden]`` tensors, prompts given as embeddings (a server started
    with --enable-prompt-embeds; integrations/openai_prompt_embeds.py)."""
    max_tokens: int | None = 16
    logprobs: LaxCount = None
    echo: Nullable[bool] = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: Nullable[int] = 1
    logprobs: Nullable[bool] = False
    top_logprobs: LaxCount = None
    """With ``logprobs``: the top-N of each token; null or left out: 0 (vLLM's default; true: 1, false: 0)."""
    tools: list[Any] | None = None
    """OpenAI function tools: rendered by the chat template, their calls read back (openai_tools.py)."""
    tool_choice: str | dict[str, Any] | None = None
    """'none', 'auto' (the default with tools), 'required', or ``{"type": "function", "function": {"name"}}``."""
    parallel_tool_calls: bool | None = None
    """False: at most one call per reply."""
    add_generation_prompt: bool = True
    """vLLM's: end the rendered prompt with the assistant's turn opening."""
    continue_final_message: bool = False
    """vLLM's: leave the last (assistant) message open, to be continued; needs add_generation_prompt false."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: variables for the chat template (``{"enable_thinking": false}`` for Qwen3)."""
    chat_template: str | None = None
    """vLLM's: a Jinja template for this request; only on a server started with --trust-request-chat-template."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """vLLM's: the image processor's settings for this request's images (``{"max_pixels": ...}``)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """OpenAI's (vLLM's values): passed to the chat template as ``reasoning_effort`` (gpt-oss's template reads it; a
    ``chat_template_kwargs`` key of that name wins), and as ``enable_thinking``, false for "none"
    (`template_kwargs`)."""
    include_reasoning: bool = True
    """vLLM's: false leaves the reasoning parser's ``reasoning`` out of the reply (streamed and not), and with it the
    choices' ``logprobs`` and ``token_ids``, which would show it."""
    echo: bool = False
    """vLLM's: the reply's content starts with the last message's when that message's role is the reply's
    (`chat_echo`); streamed, in a chunk of its own after the role."""
    # OpenAI's hosted service's fields, the first four the Responses API's too: accepted where a no-op, else a 400
    metadata: Metadata = None  # (openai_standard.py: `check_chat_service_fields`)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    verbosity: Verbosity = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


class TokenizeRequest(_Request, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    """For messages: function tools for the chat template, as chat completions take them."""
    add_special_tokens: bool | None = None
    """The tokenizer's special tokens (BOS): default true for a prompt, false for messages (their template's BOS)."""
    add_generation_prompt: bool = True
    """For messages: end with the assistant's turn opening, as chat completions do."""
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """For messages: variables for the chat template, as chat completions take them."""
    chat_template: str | None = None
    return_token_strs: Nullable[bool] = False
    """vLLM's: the response's ``token_strs`` are the tokens' strings (``convert_ids_to_tokens``); else null."""


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


_AT_FIELD = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_NAMED_FIELD = re.compile(r"field `([^`]+)`")


def decode_request(body: bytes, request_type: Any) -> Any:
    """Decode and type-check a JSON body (a Struct, or `Any`: any JSON) as vLLM's pydantic models read it (a whole
    float or a numeric string for an int, "true" for a bool; 4.5 for an int is refused); msgspec's error becomes an
    `InvalidRequestError` naming the field."""
    try:
        return msgspec.json.decode(body, type=request_type, strict=False)  # pydantic's lax reading, vLLM's: 4.0, "4"
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _AT_FIELD.search(text) or _NAMED_FIELD.search(text)
        raise InvalidRequestError(match.group(1) if match else "body", text) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError("body", f"not valid JSON: {exc}") from None
    except RecursionError:  # nested deeper than Python's recursion limit: a 2 kB body can be
        raise InvalidRequestError("body", "is JSON nested too deeply") from None


def completion_prompts(prompt: str | list[Any], limits: ServerLimits, field: str = "prompt") -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of engine prompts; errors name `field` (embeddings': ``input``)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(is_int(t) for t in prompt):
        return [list(prompt)]
    if prompt and (all(isinstance(p, str) for p in prompt) or all(_is_token_list(p) for p in prompt)):
        if len(prompt) > limits.max_prompts:
            raise InvalidRequestError(field, f"at most {limits.max_prompts} prompts per request, got {len(prompt)}")
        return list(prompt)
    raise InvalidRequestError(field, "must be a string, a list of strings, a list of token ids, or a list of those lists")


def response_id(prefix: str, req: _Common) -> str:
    """A response's id: ``prefix-`` and vLLM's ``request_id``, else a random one."""
    return f"{prefix}-{req.request_id or uuid.uuid4().hex}"


def request_options(req: _Common) -> dict[str, Any]:
    """The engine's per-request options of `AsyncEngine.stream` / `chat` (vLLM's extensions)."""
    return {"priority": req.priority, "cache_salt": req.cache_salt}


DATA_PARALLEL_RANK_HEADER = "x-data-parallel-rank"
"""vLLM's request header naming the replica that runs a completion (`AsyncEngine.stream`'s data_parallel_rank)."""


def take_request_id(req: _Common, headers: Mapping[str, str]) -> None:
    """As vLLM: the ``X-Request-Id`` header, when sent, is the request id (over the body's); too long a 400."""
    req.request_id = headers.get("x-request-id", req.request_id)
    if req.request_id is not None:
        check_request_id(req.request_id, "(or the X-Request-Id header) ")


def header_data_parallel_rank(headers: Mapping[str, str]) -> int | None:
    """The ``X-data-parallel-rank`` header's replica index; None without one."""
    raw = headers.get(DATA_PARALLEL_RANK_HEADER)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequestError("data_parallel_rank", f"the X-data-parallel-rank header must be a replica index "
                                                        f"(an int), got {raw!r}") from None


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest,
                    defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The chat template's variables of a request: the server's `defaults` (``--default-chat-template-kwargs``)
    under the request's ``add_generation_prompt``, ``continue_final_message`` and a chat completion's
    ``reasoning_effort`` (with ``enable_thinking``: whether it is not ``"none"``, as vLLM's ``build_chat_params``,
    unless ``chat_template_kwargs`` has that key; mistral_common drops it), under its ``chat_template_kwargs`` (which
    win key by key); the request's over the defaults as vLLM's ``ChatParams.with_defaults`` (until 2026-12-08 a
    default overrode the request's ``reasoning_effort``, and ``reasoning_effort`` set no ``enable_thinking``)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequestError("continue_final_message", "continues the last message: set add_generation_prompt "
                                                            "to false (a new assistant turn cannot follow it)")
    extra: dict[str, Any] = {"continue_final_message": True} if req.continue_final_message else {}
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        extra["reasoning_effort"] = effort
        extra["enable_thinking"] = effort != "none"  # a chat_template_kwargs key of that name wins, below
    return {**(defaults or {}), "add_generation_prompt": req.add_generation_prompt, **extra,
            **(req.chat_template_kwargs or {})}


def chat_role(req: ChatCompletionRequest, response_role: str = "assistant") -> str:
    """The reply's role, as vLLM's ``get_chat_request_role``: `response_role` (the server's ``--response-role``), or
    with add_generation_prompt false the last message's (the turn the reply continues)."""
    if req.add_generation_prompt or not req.messages:
        return response_role
    return req.messages[-1].get("role") or response_role


def chat_echo(req: ChatCompletionRequest, response_role: str = "assistant",
              messages: list[dict[str, Any]] | None = None) -> str:
    """vLLM's chat ``echo``: the last message's text when its role is the reply's (`chat_role`), which the reply
    continues; "" otherwise. `messages`: the request's as the prompt reads them (`openai_messages.chat_messages`:
    every part vLLM reads as text, a bare string, ``input_text``, ``refusal``, ..., a text part, one whose text is
    null dropped); by default the request's own, whose text parts alone count."""
    if not req.echo or not req.messages:
        return ""
    last = (messages or req.messages)[-1]
    if last.get("role") != chat_role(req, response_role):
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):  # parts: their texts, a line apart (as vLLM joins them)
        return "\n".join(part["text"] for part in content
                         if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))
    return content if isinstance(content, str) else ""


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


@dataclass(frozen=True)
class ChatTemplates:
    """Which chat template a request is rendered with."""

    default: str | None = None
    """The server's (``--chat-template``); None: the tokenizer's."""
    trust_request: bool = False
    """Whether a request may bring its own (``--trust-request-chat-template``): Jinja from clients."""
    default_kwargs: dict[str, Any] | None = None
    """The server's template variables (``--default-chat-template-kwargs``), under each request's own."""

    @classmethod
    def create(cls, chat_template: str | None = None, trust_request: bool = False,
               default_kwargs: dict[str, Any] | None = None) -> ChatTemplates:
        """`create_app`'s: `chat_template` a file path or the Jinja text; `default_kwargs` checked as a request's."""
        from asyncllm.tokenizer import check_template_kwargs, load_chat_template

        try:
            check_template_kwargs(default_kwargs)
        except InvalidRequestError as exc:
            raise ConfigError("default_chat_template_kwargs", default_kwargs, exc.message) from None
        default = load_chat_template(chat_template) if chat_template is not None else None
        return cls(default, trust_request, dict(default_kwargs) if default_kwargs is not None else None)

    def kwargs(self, req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
        """The request's template variables over the server's defaults (`template_kwargs`)."""
        return template_kwargs(req, self.default_kwargs)

    def pick(self, requested: str | None) -> str | None:
        if requested is None:
            return self.default
        if not self.trust_request:
            raise InvalidRequestError("chat_template", "this server does not take templates from requests (start it "
                                                       "with --trust-request-chat-template to allow them)")
        return requested
