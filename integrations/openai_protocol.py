"""OpenAI request bodies as msgspec Structs, and their mapping to `SamplingParams`.

Unknown fields are refused with a 400 naming them (OpenAI does the same), so a
client never believes an option took effect when asyncllm does not build it;
options asyncllm does not build yet (``suffix``, ``best_of`` != n) are refused
by name too. vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``allowed_token_ids``,
``bad_words``, ``truncate_prompt_tokens``, ``prompt_logprobs``, ``priority``,
``cache_salt``, ``chat_template``, ...) are accepted, as a vLLM user expects, and
so are vLLM's ``use_beam_search`` (openai_beam_search.py runs it) and
structured output: OpenAI's ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``). Tool calling (``tools``,
``tool_choice``) is read in openai_tools.py.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import msgspec

from asyncllm.engine.validation import MAX_REQUEST_ID_CHARS
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import SamplingParams, StructuredOutputs
from asyncllm.integrations.openai_structured import structured_output

__all__ = [
    "ServerLimits", "StreamOptions", "CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
    "decode_request", "completion_params", "chat_params", "completion_prompts", "request_options", "take_request_id",
    "check_common",
    "echo_only", "template_kwargs", "resolve_max_tokens", "sets_max_tokens", "response_id", "ChatTemplates",
]


@dataclass(frozen=True)
class ServerLimits:
    """Per-request bounds the server enforces before anything reaches the engine."""

    max_body_bytes: int = 64 << 20
    """Largest request body (413 beyond): a bound against abuse that still takes a few photos as data URLs."""
    max_audio_bytes: int = 25 << 20
    """Largest upload to ``/v1/audio/transcriptions`` and ``/translations`` (413 beyond; OpenAI's 25 MB)."""
    max_n: int = 128
    """Largest `n` (samples per prompt; and a beam search's width): RL rollouts' n of 64 or 128 fit (vLLM has no
    limit; the engine's own is 1024)."""
    max_tokens: int | None = None
    """Largest `max_tokens`; None = the model's max_model_len bounds it."""
    max_prompts: int = 2048
    """Most prompts in one /v1/completions request (a list prompt), or inputs in one /v1/embeddings request (OpenAI's
    embeddings limit; vLLM has none)."""

    def check_sequences(self, prompts: int, n: int, field: str = "n") -> None:
        """`InvalidRequestError` naming `field` when prompts x n exceed max(max_prompts, max_n): no product."""
        most = max(self.max_prompts, self.max_n)
        if prompts * n > most:
            raise InvalidRequestError(field, f"{prompts} prompts x {n} = {prompts * n} sequences (at most {most})")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    """Send one last chunk with the request's token usage (and no choices)."""
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries the usage so far (instead of null)."""


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    """The served model's name; left out, the served model (as vLLM's server)."""
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
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
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep the prompt's last k tokens (-1: as many as max_model_len allows)."""
    prompt_logprobs: int | None = None
    """vLLM's: each prompt token's logprob and the N most likely there (not with stream)."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    """OpenAI's: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", ...}}``."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (EBNF), ``json_object: true``."""
    priority: int = 0
    """vLLM's: lower runs first; needs an engine started with scheduling_policy='priority' unless 0."""
    cache_salt: str | None = None
    """vLLM's: requests with different salts never share prefix-cached KV."""
    use_beam_search: bool = False
    """vLLM's: beam search of width n (completions: best_of when given) instead of sampling (openai_beam_search.py)."""
    length_penalty: float = 1.0
    """vLLM's, with use_beam_search: beams are ranked by cumulative logprob / length ** length_penalty."""
    request_id: str | None = None
    """vLLM's: the response's id is ``cmpl-`` / ``chatcmpl-`` and this (by default a random one)."""
    return_token_ids: bool = False
    """vLLM's: each choice carries its ``token_ids``, and the prompt's ``prompt_token_ids`` (not with stream)."""
    add_special_tokens: bool | None = None
    """vLLM's: tokenize the prompt with the tokenizer's special tokens (BOS); only its default is built: true for
    completions, false for chat (whose template writes them)."""


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[Any] | None = None
    """A string, a list of strings, a list of token ids, or a list of token-id lists (or `prompt_embeds`)."""
    prompt_embeds: str | list[str] | None = None
    """vLLM's: base64 ``torch.save``'d ``[tokens, hidden]`` tensors, prompts given as embeddings (a server started
    with --enable-prompt-embeds; integrations/openai_prompt_embeds.py)."""
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
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
    ``chat_template_kwargs`` key of that name wins)."""
    include_reasoning: bool = True
    """vLLM's: false leaves the reasoning parser's ``reasoning`` out of the reply (streamed and not)."""


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    """For messages: function tools for the chat template, as chat completions take them."""
    add_special_tokens: bool = True
    """For a prompt: the tokenizer's special tokens (BOS), as the engine adds them."""
    add_generation_prompt: bool = True
    """For messages: end with the assistant's turn opening, as chat completions do."""
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """For messages: variables for the chat template, as chat completions take them."""
    chat_template: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


_AT_FIELD = re.compile(r"at `\$\.([A-Za-z_]+)")
_NAMED_FIELD = re.compile(r"field `([^`]+)`")


def decode_request(body: bytes, request_type: type[msgspec.Struct]) -> Any:
    """Decode and type-check a JSON body; msgspec's error becomes an `InvalidRequestError` naming the field."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _AT_FIELD.search(text) or _NAMED_FIELD.search(text)
        raise InvalidRequestError(match.group(1) if match else "body", text) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError("body", f"not valid JSON: {exc}") from None


def completion_prompts(prompt: str | list[Any], limits: ServerLimits, field: str = "prompt") -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of engine prompts; errors name `field` (embeddings': ``input``)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_int(t) for t in prompt):
        return [list(prompt)]
    if prompt and (all(isinstance(p, str) for p in prompt) or all(_is_token_list(p) for p in prompt)):
        if len(prompt) > limits.max_prompts:
            raise InvalidRequestError(field, f"at most {limits.max_prompts} prompts per request, got {len(prompt)}")
        return list(prompt)
    raise InvalidRequestError(field, "must be a string, a list of strings, a list of token ids, or a list of those lists")


def sets_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request sets its max_tokens (completions' default 16 counts, as in vLLM): then a prompt plus
    max_tokens over max_model_len is a 400, as vLLM's server answers; unset, a reply runs to the room left."""
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens is not None or req.max_tokens is not None
    return req.max_tokens is not None


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
    if req.request_id is not None and len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"(or the X-Request-Id header) must be at most {MAX_REQUEST_ID_CHARS} "
                                                f"characters, got {len(req.request_id)}")


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


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The chat template's variables of a request: ``add_generation_prompt``, ``continue_final_message`` and a chat
    completion's ``reasoning_effort``, then ``chat_template_kwargs`` (which win)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequestError("continue_final_message", "continues the last message: set add_generation_prompt "
                                                            "to false (a new assistant turn cannot follow it)")
    extra = {"continue_final_message": True} if req.continue_final_message else {}
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        extra["reasoning_effort"] = effort
    return {"add_generation_prompt": req.add_generation_prompt, **extra, **(req.chat_template_kwargs or {})}


def completion_params(req: CompletionRequest, limits: ServerLimits,
                      defaults: Mapping[str, Any] = MappingProxyType({})) -> SamplingParams:
    """`SamplingParams` of a completion; with ``echo`` and ``logprobs`` the prompt's logprobs too.

    ``echo`` with ``max_tokens`` 0 (the prompt's logprobs alone, as evaluation
    harnesses ask) generates one token that the response leaves out
    (`echo_only`).
    """
    _refuse(req.suffix is not None, "suffix", "suffix (insertion) is not built yet")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of", "only best_of == n is supported (no server-side ranking)")
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        _refuse(req.n != 1, "echo", "with logprobs needs n=1 (the prompt's logprobs are computed once)")
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    max_tokens = 1 if echo_only(req) else req.max_tokens
    return _params(req, max_tokens, req.logprobs, limits, defaults, prompt_logprobs)


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the response is the prompt alone."""
    return req.echo and req.max_tokens == 0


def chat_params(req: ChatCompletionRequest, limits: ServerLimits, tool_constraint: StructuredOutputs | None = None,
                defaults: Mapping[str, Any] = MappingProxyType({})) -> SamplingParams:
    """`SamplingParams` of a chat completion; `tool_constraint` is a named or required tool choice's output schema,
    `defaults` the engine's default sampling fields (`AsyncEngine.default_sampling_fields`) for unset ones."""
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return _params(req, max_tokens, logprobs, limits, defaults, req.prompt_logprobs, tool_constraint)


def resolve_max_tokens(max_tokens: int | None, limits: ServerLimits, defaults: Mapping[str, Any]) -> int | None:
    """The request's max_tokens, else the model's default, else the server's limit (None: up to max_model_len);
    more than the limit is an `InvalidRequestError`."""
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    if limits.max_tokens is not None:
        if max_tokens is None:
            return limits.max_tokens
        if max_tokens > limits.max_tokens:
            raise InvalidRequestError("max_tokens", f"at most {limits.max_tokens} on this server, got {max_tokens}")
    return max_tokens


def _params(req: _Common, max_tokens: int | None, logprobs: int | None, limits: ServerLimits,
            defaults: Mapping[str, Any], prompt_logprobs: int | None = None,
            tool_constraint: StructuredOutputs | None = None) -> SamplingParams:
    _check_combinations(req)
    if _is_int(req.n) and req.n > limits.max_n:
        raise InvalidRequestError("n", f"at most {limits.max_n} on this server, got {req.n}")
    max_tokens = resolve_max_tokens(max_tokens, limits, defaults)
    params = SamplingParams(
        n=req.n, temperature=_unset_or(req.temperature, defaults, "temperature", 1.0),
        top_p=_unset_or(req.top_p, defaults, "top_p", 1.0), top_k=_unset_or(req.top_k, defaults, "top_k", 0),
        min_p=_unset_or(req.min_p, defaults, "min_p", 0.0), seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=[] if req.stop is None else req.stop, stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=_unset_or(req.repetition_penalty, defaults, "repetition_penalty", 1.0),
        logit_bias=req.logit_bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or [],
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
    params.structured, field = structured_output(req.response_format, req.structured_outputs)
    if tool_constraint is not None:
        if params.structured is not None:
            raise InvalidRequestError("tool_choice", f"a named or 'required' tool choice constrains the output: "
                                                     f"it cannot be combined with {field}")
        params.structured, field = tool_constraint, "tools"
    try:
        params.validate()
    except InvalidRequestError as exc:  # the constraint's errors name the field the client used
        raise InvalidRequestError(field, exc.message, code=exc.code) if exc.field == "structured" else exc from None
    return params


def _check_combinations(req: _Common) -> None:
    """`InvalidRequestError` for fields that do not go together, or a value of one that is not built."""
    _refuse(req.stream and req.prompt_logprobs is not None, "prompt_logprobs", "is not available when streaming")
    _refuse(req.length_penalty != 1.0, "length_penalty", "applies to beam search only (use_beam_search: true)")
    check_common(req)


def check_common(req: _Common) -> None:
    """The refusals sampling and beam search share (stream_options, return_token_ids, add_special_tokens)."""
    _refuse(req.stream_options not in (None, StreamOptions()) and not req.stream, "stream_options",  # {}: as vLLM
            "Stream options can only be defined when stream=True")
    _refuse(req.stream and req.return_token_ids, "return_token_ids", "is not built with stream yet")
    chat = isinstance(req, ChatCompletionRequest)
    _refuse(req.add_special_tokens not in (None, not chat), "add_special_tokens",
            f"only its default ({str(not chat).lower()} here) is built")


def _unset_or(value: Any, defaults: Mapping[str, Any], field: str, fallback: Any) -> Any:
    """A request's field; when unset (None), the engine's default for it, else `fallback`."""
    return value if value is not None else defaults.get(field, fallback)


def _refuse(condition: bool, field: str, why: str) -> None:
    if condition:
        raise InvalidRequestError(field, why)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


@dataclass(frozen=True)
class ChatTemplates:
    """Which chat template a request is rendered with."""

    default: str | None = None
    """The server's (``--chat-template``); None: the tokenizer's."""
    trust_request: bool = False
    """Whether a request may bring its own (``--trust-request-chat-template``): Jinja from clients."""

    def pick(self, requested: str | None) -> str | None:
        if requested is None:
            return self.default
        if not self.trust_request:
            raise InvalidRequestError("chat_template", "this server does not take templates from requests (start it "
                                                       "with --trust-request-chat-template to allow them)")
        return requested
