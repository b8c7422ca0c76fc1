"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``: `AsyncEngine.beam_search`
behind the OpenAI bodies.

The beam width is ``n`` (as vLLM), or completions' ``best_of`` when given
(then the best ``n`` of the ``best_of`` beams are returned); the response has
``n`` choices per prompt, the beams best first, each with its text and
finish_reason ("stop": it ended with EOS, "length"). ``max_tokens``,
``ignore_eos`` and vLLM's ``length_penalty`` go to `BeamSearchParams`.
Beam search follows the model's raw logprobs: ``temperature`` (vLLM passes it
to its steps, where under its default ``raw_logprobs`` it ranks nothing) changes
no beam, the generation config's sampling defaults do not apply (its suppressed ids
do), and every field that
would change the distribution or the output (penalties, ``logit_bias``,
``stop``, structured output, tools, ...) is a 400 naming it, never ignored.
``logprobs`` (completions) / ``top_logprobs`` (chat) give each chosen token's
logprob and up to ``2 * beam_width`` alternatives: the tokens each step ranks (more
is a 400 before the search runs). ``max_tokens`` stops at ``max_model_len``
(`beam_max_tokens`, the engine's rule).
Streamed, the search runs to its end first (as vLLM's, whose beam search
yields once) and each choice comes whole in one chunk. Usage: each prompt's
tokens once, completion tokens summed over the returned beams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from asyncllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_max_tokens, text_prompt_ids
from asyncllm.engine.validation import truncated_prompt
from asyncllm.errors import InvalidRequestError, check_context_length
from asyncllm.integrations.openai_http import EventStream, json_response
from asyncllm.integrations.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ServerLimits,
    chat_role,
    completion_prompts,
    response_id,
)
from asyncllm.integrations.openai_request_log import log_prompts
from asyncllm.integrations.openai_sampling import chat_logprobs, check_common, resolve_max_tokens, sets_max_tokens
from asyncllm.integrations.openai_responses import Choices, chat_chunk, chat_stream_choices, sse_event
from asyncllm.integrations.openai_streaming import chunk_usage, usage_mode
from asyncllm.integrations.openai_tokenize import chat_tokens
from asyncllm.integrations.starlette import wait_disconnect
from asyncllm.integrations.streams import ClientDisconnected
from asyncllm.outputs import StreamDelta

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.integrations.openai_server import OpenAIServer
    from asyncllm.lora import LoRARequest

__all__ = ["beam_search_response", "check_beam_search_request"]


def check_beam_search_request(req: CompletionRequest | ChatCompletionRequest) -> None:
    """`InvalidRequestError` naming the first field beam search cannot honour (after the ones sampling refuses too)."""
    check_common(req)
    raw, no_sampling = "beam search follows the raw logprobs", "beam search does not sample"
    refusals: list[tuple[bool, str, str]] = [
        (req.top_p not in (None, 1), "top_p", f"only 1 or unset ({no_sampling})"),
        (req.top_k not in (None, 0, -1), "top_k", f"only 0, -1 or unset ({no_sampling})"),
        (req.min_p not in (None, 0), "min_p", f"only 0 or unset ({no_sampling})"),
        (req.presence_penalty != 0, "presence_penalty", f"only 0 ({raw})"),
        (req.frequency_penalty != 0, "frequency_penalty", f"only 0 ({raw})"),
        (req.repetition_penalty not in (None, 1), "repetition_penalty", f"only 1 or unset ({raw})"),
        (bool(req.logit_bias), "logit_bias", f"not built ({raw})"),
        (bool(req.stop), "stop", "not built (beam search has no stop strings: EOS ends a beam)"),
        (bool(req.stop_token_ids), "stop_token_ids", "not built (EOS alone ends a beam)"),
        (req.min_tokens != 0, "min_tokens", "not built"),
        (req.allowed_token_ids is not None, "allowed_token_ids", "not built"),
        (bool(req.bad_words), "bad_words", "not built"),
        (req.prompt_logprobs is not None, "prompt_logprobs", "not built"),
        (not req.skip_special_tokens, "skip_special_tokens", "only true (the beams' text leaves special tokens out)"),
        (req.include_stop_str_in_output, "include_stop_str_in_output", "only false (beam search has no stop strings)"),
        (req.response_format is not None and req.response_format.get("type") != "text", "response_format",
         "structured output is not built"),
        (req.structured_outputs is not None, "structured_outputs", "structured output is not built"),
        (req.return_token_ids, "return_token_ids", "not built"),
    ]
    if isinstance(req, CompletionRequest):
        refusals += [
            (req.echo, "echo", "not built"),
            (req.suffix is not None, "suffix", "not built"),
            (req.best_of is not None and req.best_of < req.n, "best_of", "is the beam width: at least n"),
        ]
    else:
        refusals += [
            (req.echo, "echo", "not built"),
            (bool(req.tools), "tools", "tool calling is not built"),
            (req.tool_choice not in (None, "none"), "tool_choice", "tool calling is not built"),
        ]
    for refused, field, why in refusals:
        if refused:
            raise InvalidRequestError(field, f"with use_beam_search: {why}")


async def beam_search_response(server: OpenAIServer, request: Request, req: CompletionRequest | ChatCompletionRequest,
                               model: str, lora: LoRARequest | None) -> Response:
    """The response of a ``use_beam_search`` request (see the module docstring)."""
    chat = isinstance(req, ChatCompletionRequest)
    check_beam_search_request(req)
    top_logprobs = chat_logprobs(req) if chat else req.logprobs
    if chat and server.reasoning is not None and server.reasoning.needs_special_tokens:
        raise InvalidRequestError("use_beam_search", "not built with this server's reasoning parser (its markers are "
                                  "special tokens, which the beams' text leaves out)")
    width = req.best_of if isinstance(req, CompletionRequest) and req.best_of is not None else req.n
    for field, value in (("n", req.n), ("best_of", width)):
        if value < 1:
            raise InvalidRequestError(field, f"is the beam width: at least 1, got {value}")
        if value > server.limits.max_n:
            raise InvalidRequestError(field, f"at most {server.limits.max_n} on this server, got {value}")
    if top_logprobs is not None and top_logprobs > 2 * width:  # before the search runs
        raise InvalidRequestError("top_logprobs" if chat else "logprobs", f"with use_beam_search: at most 2 * beam "
                                  f"width = {2 * width} (the alternatives each step ranks), got {top_logprobs}")
    defaults = await server._sampling_defaults()  # starts the engine
    engine = server.engine
    max_model_len = engine.config.max_model_len
    if chat:  # as the engine's chat: special tokens only with add_special_tokens true (the template writes BOS)
        chat_ids = await chat_tokens(server, req, add_special_tokens=bool(req.add_special_tokens),
                                     cuttable=req.truncate_prompt_tokens is not None)
        prompts = [truncated_prompt(chat_ids, req.truncate_prompt_tokens, max_model_len)]
    else:
        texts = completion_prompts(req.prompt, server.limits)
        server.limits.check_sequences(len(texts), width, "n" if width == req.n else "best_of")
        prompts = [await _completion_prompt_ids(engine, prompt, req.truncate_prompt_tokens,
                                                req.add_special_tokens is not False) for prompt in texts]
    max_tokens = _max_tokens(req, server.limits, defaults)
    params = []
    for ids in prompts:
        check_context_length(max_model_len, len(ids), max_tokens if sets_max_tokens(req) else None)  # as sampling
        params.append(BeamSearchParams(width, beam_max_tokens(max_model_len, len(ids), max_tokens), req.ignore_eos,
                                       temperature=req.temperature or 0.0, length_penalty=req.length_penalty))
        try:
            params[-1].validate(engine.config.max_logprobs)
        except InvalidRequestError as exc:  # name the request's field
            field = {"beam_width": "n" if width == req.n else "best_of"}.get(exc.field, exc.field)
            raise InvalidRequestError(field, exc.message, code=exc.code) from None
    options = {"priority": req.priority, "cache_salt": req.cache_salt, "lora_request": lora}
    log_prompts(server.request_log, req, "chatcmpl" if chat else "cmpl", prompts, params, lora, indexed=not chat)
    outputs = await _search_all(engine, prompts, params, options, until=lambda: wait_disconnect(request))
    choices = Choices(len(prompts), req.n, top_logprobs, chat=chat, reasoning=server.reasoning if chat else None,
                      token_ids_as_text=server.ids_as_text(req),
                      include_reasoning=not chat or req.include_reasoning,
                      chat_role=chat_role(req, server.response_role) if chat else "assistant",
                      reasoning_end=server.reasoning_end() if chat else None,
                      thinking_off=chat and server.thinking_off(server.templates.kwargs(req)))
    for prompt_index, ids in enumerate(prompts):
        choices.prompt_tokens[prompt_index] = len(ids)
        choices.ended_thinking(prompt_index, ids)
    deltas = _deltas(prompts, outputs, req.n, top_logprobs is not None)
    kind = "chat.completion" if chat else "text_completion"
    meta = {"id": response_id("chatcmpl" if chat else "cmpl", req),
            "object": kind + ".chunk" if chat and req.stream else kind, "created": int(time.time()), "model": model}
    if req.stream:
        events = _sse(req, choices, deltas, meta, server.force_include_usage)
        return EventStream(events)
    for prompt_index, delta in deltas:
        choices.add(prompt_index, delta)
    body = {**meta, "choices": choices.final_choices(), "usage": choices.usage()}
    return json_response(body)


async def _completion_prompt_ids(engine: AsyncEngine, prompt: str | list[int], truncate_prompt_tokens: int | None,
                                 add_special_tokens: bool) -> list[int]:
    """A completion prompt's token ids, as the engine tokenizes and cuts them (text off the event loop): a text's
    by the tokenizer on the left, BOS kept (`add_special_tokens`); token ids' last k."""
    if not isinstance(prompt, str):  # the engine checks the ids at the first step
        return truncated_prompt(list(prompt), truncate_prompt_tokens, engine.config.max_model_len)
    return await text_prompt_ids(engine, prompt, truncate_prompt_tokens, add_special_tokens)  # as beam_search's


def _max_tokens(req: CompletionRequest | ChatCompletionRequest, limits: ServerLimits,
                defaults: dict[str, Any]) -> int | None:
    """The request's max_tokens (chat: max_completion_tokens first) resolved as for sampling; None: up to
    max_model_len."""
    requested = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        requested = req.max_completion_tokens
    return resolve_max_tokens(requested, limits, defaults)


async def _search_all(engine: AsyncEngine, prompts: Sequence[list[int]], params: Sequence[BeamSearchParams],
                      options: dict[str, Any], until: Callable[[], Awaitable[object]]) -> list[BeamSearchOutput]:
    """Every prompt's beam search at once, results in prompt order; the first error cancels the others (each
    cancelled step aborts its requests in the engine), and so does the client leaving (`ClientDisconnected`)."""
    tasks = [asyncio.ensure_future(engine.beam_search(ids, p, **options)) for ids, p in zip(prompts, params)]
    watcher = asyncio.ensure_future(until())
    try:
        pending = set(tasks)
        while pending:
            done, _ = await asyncio.wait({*pending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise ClientDisconnected()
            for task in sorted(done, key=tasks.index):
                task.result()
            pending -= done
        return [task.result() for task in tasks]
    finally:
        for future in [*tasks, watcher]:
            future.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _deltas(prompts: Sequence[list[int]], outputs: Sequence[BeamSearchOutput], n: int,
            logprobs: bool) -> list[tuple[int, StreamDelta]]:
    """(prompt index, delta) per returned beam: each beam whole as one delta of sample `rank` (its text, output
    tokens, finish_reason and, when asked, its per-token logprob entries: the chosen token among the step's
    top ``2 * beam_width``)."""
    out = []
    for prompt_index, (ids, output) in enumerate(zip(prompts, outputs)):
        for rank, beam in enumerate(output.sequences[:n]):
            entries = list(beam.logprobs) if logprobs else None
            out.append((prompt_index, StreamDelta(rank, beam.text, beam.tokens[len(ids):], beam.finish_reason,
                                                  logprobs=entries)))
    return out


async def _sse(req: CompletionRequest | ChatCompletionRequest, choices: Choices,
               deltas: list[tuple[int, StreamDelta]], meta: dict[str, Any],
               force_include_usage: bool) -> AsyncIterator[bytes]:
    """The chunks of a finished search: chat's role chunks, then each choice whole in one chunk (its text,
    logprobs and finish_reason), the usage chunk when asked or forced (`usage_mode`), ``[DONE]``."""
    usage = usage_mode(req, force_include_usage)

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse_event({**meta, "choices": [choice], **chunk_usage(choices, choice["index"], usage)})

    if choices.chat:
        for index in range(len(deltas)):
            yield chunk(chat_chunk(index, {"role": choices.chat_role, "content": ""}))
    for prompt_index, delta in deltas:
        index, logprobs = choices.add(prompt_index, delta)
        if choices.chat:
            for choice in chat_stream_choices(choices, index, delta, logprobs):
                yield chunk(choice)
        else:
            yield chunk({"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                         "stop_reason": delta.stop_reason})
    if usage != "none":
        yield sse_event({**meta, "choices": [], "usage": choices.usage()})
    yield b"data: [DONE]\n\n"
