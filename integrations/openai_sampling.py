"""OpenAI request bodies (openai_protocol.py) mapped to `SamplingParams`, refusing what is not built.

Fields that do not go together, and values asyncllm does not build yet
(``suffix``, ``best_of`` != n, ``length_penalty`` without beam search), are
refused by name; request fields left unset take the engine's defaults (the
model's generation config), then the server's limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import msgspec

from asyncllm.config_checks import is_int
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_protocol import ChatCompletionRequest, CompletionRequest, ServerLimits
from asyncllm.integrations.openai_standard import check_chat_service_fields, check_stream_options, refuse_failed
from asyncllm.integrations.openai_structured import (
    check_response_format_keys, constraint_errors, structured_output,
)
from asyncllm.integrations.openai_tools import ToolMode
from asyncllm.sampling import SamplingParams, StructuredOutputs

if TYPE_CHECKING:
    from asyncllm.reasoning import ReasoningParser

__all__ = ["completion_params", "chat_params", "chat_field_names", "chat_logprobs", "check_common", "echo_only",
           "resolve_max_tokens", "sets_max_tokens", "with_max_tokens_cap"]

GenerationRequest = CompletionRequest | ChatCompletionRequest
"""Either generation request (the fields they share are `openai_protocol._Common`'s)."""


def sets_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request sets its max_tokens (completions' default 16 counts, as in vLLM): then a prompt plus
    max_tokens over max_model_len is a 400, as vLLM's server answers; unset, a reply runs to the room left."""
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens is not None or req.max_tokens is not None
    return req.max_tokens is not None



def completion_params(req: CompletionRequest, limits: ServerLimits,
                      defaults: Mapping[str, Any] = MappingProxyType({})) -> SamplingParams:
    """`SamplingParams` of a completion; with ``echo`` and ``logprobs`` the prompt's logprobs too.

    ``echo`` with ``max_tokens`` 0 (the prompt's logprobs alone, as evaluation
    harnesses ask) generates one token that the response leaves out
    (`echo_only`).
    """
    refuse_failed([(req.suffix is not None, "suffix", "suffix (insertion) is not built yet")])
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of", "only best_of == n is supported (no server-side ranking)")
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:  # every choice's logprobs start with the prompt's (vLLM's, n > 1 too)
        prompt_logprobs = -1 if -1 in (req.logprobs, prompt_logprobs) else max(req.logprobs, prompt_logprobs or 0)
    if echo_only(req) and req.min_tokens:  # named by what the client sent, not the one token run for it
        raise InvalidRequestError("min_tokens", f"{req.min_tokens} exceeds max_tokens=0")
    max_tokens = 1 if echo_only(req) else req.max_tokens
    return _params(req, max_tokens, req.logprobs, limits, defaults, prompt_logprobs)


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the response is the prompt alone."""
    return req.echo and req.max_tokens == 0


def chat_params(req: ChatCompletionRequest, limits: ServerLimits, mode: ToolMode = ToolMode("none"),
                reasoning: ReasoningParser | None = None,
                defaults: Mapping[str, Any] = MappingProxyType({}), *, thinking_off: bool = False) -> SamplingParams:
    """`SamplingParams` of a chat completion whose reply is read in tool `mode` (a named or required tool choice
    constrains the output to its schema) and with the `reasoning` parser; `defaults` are the engine's default
    sampling fields (`AsyncEngine.default_sampling_fields`) for unset ones; `thinking_off`: the request turned the
    thinking off (`ReasoningParser.thinking_off`), so a constraint applies from the first token unless the prompt's
    end opened the thinking anyway (`Marker.starts_answer`)."""
    if mode.constraint is not None and reasoning is not None and not reasoning.forced_tool_calls:
        raise InvalidRequestError("tool_choice", "a named or 'required' choice is not built with this reasoning "
                                  "parser (gpt-oss writes a call as a message of its own); use 'auto'")
    logprobs = chat_logprobs(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _params(req, max_tokens, logprobs, limits, defaults, req.prompt_logprobs, mode.constraint)
    if mode.parser is not None and mode.parser.needs_special_tokens:  # its calls open with a special token
        params.skip_special_tokens = False
    if reasoning is not None and reasoning.needs_special_tokens:  # harmony's channel markers
        params.skip_special_tokens = False
    if reasoning is not None and params.structured is not None:  # think, then the grammar
        params.structured = msgspec.structs.replace(params.structured, start_after=reasoning.end_tag,
                                                    start_after_suffix=reasoning.end_suffix,
                                                    start_after_max_between=reasoning.end_max_between,
                                                    start_after_opener=reasoning.opener,
                                                    start_after_only_if_opened=thinking_off,
                                                    start_after_only_if_reply_opens=reasoning.opened_first,
                                                    start_after_opener_after_space=reasoning.opened_after_space)
    return params


def chat_field_names(req: ChatCompletionRequest) -> dict[str, str]:
    """The chat's names of fields its errors name otherwise (`renamed_fields`): ``top_logprobs``, the count the
    engine's ``logprobs`` is (`chat_logprobs`; chat's ``logprobs`` is a bool), and ``max_completion_tokens`` when set,
    which `chat_params` reads before ``max_tokens``."""
    names = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return names


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """The top-N logprobs of a chat's tokens (None: no logprobs), as vLLM reads them: ``top_logprobs`` null or left
    out is 0 (each token's own logprob and ``top_logprobs: []``); above 0 it needs ``logprobs: true``, 0 does not;
    -1 is the whole vocabulary (it needs ``logprobs: true`` too), below -1 an error naming ``top_logprobs``."""
    if is_int(req.top_logprobs) and req.top_logprobs < -1:
        raise InvalidRequestError("top_logprobs", f"must be a non-negative value or -1, got {req.top_logprobs}")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    return (req.top_logprobs or 0) if req.logprobs else None


MAX_TOKENS_CAP = "max_tokens_cap"
"""The key of the server's sampling defaults (`with_max_tokens_cap`) that caps every request's max_tokens."""


def with_max_tokens_cap(defaults: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """The engine's default sampling fields plus vLLM's ``override_max_tokens`` under `MAX_TOKENS_CAP`: with a
    generation_config folder its max_new_tokens (overrides included), else (``auto``, ``vllm``) the config's
    override_generation_config's; None: no cap. `config`: the engine's (`EngineConfig` or `ModelConfig`)."""
    if config.generation_config in ("auto", "vllm"):
        cap = (config.override_generation_config or {}).get("max_tokens")
    else:
        cap = defaults.get("max_tokens")
    return {**defaults, MAX_TOKENS_CAP: cap}


def resolve_max_tokens(max_tokens: int | None, limits: ServerLimits, defaults: Mapping[str, Any]) -> int | None:
    """vLLM's ``get_max_tokens``: the request's max_tokens, else the model's default, at most the cap of the
    defaults (`with_max_tokens_cap`); else the server's limit (None: up to max_model_len, which the engine cuts to
    the room left); a request's value over the limit is an `InvalidRequestError`, a default over it (the request
    sent none) is cut to it: the client asked for nothing it could be refused."""
    sent = max_tokens is not None
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    cap = defaults.get(MAX_TOKENS_CAP)
    if cap is not None:
        max_tokens = cap if max_tokens is None else min(max_tokens, cap)
    if limits.max_tokens is not None:
        if max_tokens is None or (not sent and max_tokens > limits.max_tokens):
            return limits.max_tokens
        if max_tokens > limits.max_tokens:
            raise InvalidRequestError("max_tokens", f"at most {limits.max_tokens} on this server, got {max_tokens}")
    return max_tokens


def _params(req: GenerationRequest, max_tokens: int | None, logprobs: int | None, limits: ServerLimits,
            defaults: Mapping[str, Any], prompt_logprobs: int | None = None,
            tool_constraint: StructuredOutputs | None = None) -> SamplingParams:
    _check_combinations(req)
    if is_int(req.n) and req.n > limits.max_n:
        raise InvalidRequestError("n", f"at most {limits.max_n} on this server, got {req.n}")
    max_tokens = resolve_max_tokens(max_tokens, limits, defaults)
    params = SamplingParams(
        n=req.n, temperature=_unset_or(req.temperature, defaults, "temperature", 1.0),
        top_p=_unset_or(req.top_p, defaults, "top_p", 1.0), top_k=_unset_or(req.top_k, defaults, "top_k", 0),
        min_p=_unset_or(req.min_p, defaults, "min_p", 0.0), seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=[] if req.stop is None else req.stop, stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=_unset_or(req.repetition_penalty, defaults, "repetition_penalty", 1.0),
        logit_bias=_clamped(req.logit_bias), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or [],
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
    params.structured, field = structured_output(req.response_format, req.structured_outputs)
    if tool_constraint is not None:
        if params.structured is not None:
            raise InvalidRequestError("tool_choice", f"a named or 'required' tool choice constrains the output: "
                                                     f"it cannot be combined with {field}")
        params.structured, field = tool_constraint, "tools"
    with constraint_errors(field):
        params.validate()
    return params


def _check_combinations(req: GenerationRequest) -> None:
    """`InvalidRequestError` for fields that do not go together, or a value of one that is not built."""
    # as vLLM's check_logprobs: a stream carries no prompt logprobs, so a count asking for some is refused (0 passes)
    refuse_failed([
        (req.stream and req.prompt_logprobs is not None and (req.prompt_logprobs > 0 or req.prompt_logprobs == -1),
         "prompt_logprobs", "is not available when streaming"),
        (req.length_penalty != 1.0, "length_penalty", "applies to beam search only (use_beam_search: true)"),
    ])
    check_common(req)


def check_common(req: GenerationRequest) -> None:
    """The refusals sampling and beam search share (stream_options, response_format's keys, chat's hosted service's
    fields, ...)."""
    check_stream_options(req.stream_options, req.stream)
    if isinstance(req, ChatCompletionRequest):
        check_chat_service_fields(req)
    if req.response_format is not None:
        check_response_format_keys(req.response_format)


def _unset_or(value: Any, defaults: Mapping[str, Any], field: str, fallback: Any) -> Any:
    """A request's field; when unset (None), the engine's default for it, else `fallback`."""
    return value if value is not None else defaults.get(field, fallback)


def _clamped(logit_bias: dict[str, float] | None) -> dict[str, float] | None:
    """A request's biases clamped to OpenAI's [-100, 100], as vLLM's server clamps them (-1000 bans a token there
    too); NaN is left for `SamplingParams.validate` to refuse by name."""
    if not logit_bias:
        return logit_bias
    return {token: bias if bias != bias else min(100.0, max(-100.0, bias)) for token, bias in logit_bias.items()}

