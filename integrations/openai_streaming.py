"""Completions' and chat completions' responses from their engine streams: SSE chunks, or one JSON body.

Streaming, the first delta of every stream is awaited before the response
starts, so an error before the first token keeps its status code (and a client
that leaves meanwhile, queued behind a full engine, aborts its requests: a 499);
after that an error is reported in the stream. Completions' ``echo`` puts each prompt
before its choices. The Responses API's events (responses_api.py) are streamed
here too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncllm.errors import AsyncLLMError
from asyncllm.integrations.errors import ApiError, error_body
from asyncllm.integrations.openai_http import EventStream, json_response
from asyncllm.integrations.openai_protocol import ChatCompletionRequest, CompletionRequest, response_id
from asyncllm.integrations.openai_responses import Choices, chat_chunk, chat_stream_choices, sse_event
from asyncllm.integrations.openai_structured import constraint_errors
from asyncllm.integrations.responses_api import ResponseEvents
from asyncllm.integrations.starlette import wait_disconnect
from asyncllm.integrations.streams import (ClientDisconnected, accepted_streams, first_deltas, gather_until,
                                           merge_streams)

if TYPE_CHECKING:
    from asyncllm.engine.stream import RequestStream

__all__ = ["respond", "count_prompts", "response_events", "usage_mode", "chunk_usage", "ChunkEncoder"]

logger = logging.getLogger("asyncllm.integrations.openai")

Echoed = list[tuple[int, dict[str, Any] | None, str]]
"""Completions' echo when streaming: one (choice index, prompt logprobs, prompt text) per choice."""


async def respond(request: Request, req: CompletionRequest | ChatCompletionRequest, model: str,
                  streams: list[RequestStream], choices: Choices, id_prefix: str, kind: str,
                  echo: tuple[list[str | list[int]], Any] | None = None, force_include_usage: bool = False,
                  constraint: str = "response_format") -> Response:
    """The response of `streams`: SSE chunks with ``stream``, else one JSON body. `echo`: completions' prompts to
    put first, and the tokenizer that gives prompts of token ids their text (None: none loaded).
    `force_include_usage` (vLLM's --enable-force-include-usage): continuous usage and the usage chunk, asked or
    not (`usage_mode`). `constraint`: the field that set the output constraint (`constraint_field`), which an
    error event of the constraint names (the caller's `constraint_errors` ends when the stream begins)."""
    chunk_kind = kind + ".chunk" if choices.chat else kind
    meta = {"id": response_id(id_prefix, req), "object": chunk_kind if req.stream else kind,
            "created": int(time.time()), "model": model}
    if req.stream:
        choices.streaming = True
        # errors before the first token keep their status code; a client gone while queued is a 499 (`guard`)
        if echo is None and len(streams) > 1:  # a prompt list: prompts queued behind a full engine hold up none
            held, steps = await accepted_streams(streams, until=lambda: wait_disconnect(request))
            firsts: list[Any] = []
        else:
            firsts, held, steps = await first_deltas(streams, until=lambda: wait_disconnect(request)), [], {}
        count_prompts(streams, choices)
        if echo is not None:
            held = await _hold_for_prompt_logprobs(streams, firsts, choices, lambda: wait_disconnect(request))
        echoed = await _echo(choices, streams, *echo, firsts) if echo is not None else []
        events = _sse(request, streams, firsts, choices, meta, usage_mode(req, force_include_usage), echoed, held,
                      steps, constraint)
        return EventStream(events)
    async for prompt_index, delta in merge_streams(streams, until=lambda: wait_disconnect(request)):
        choices.add(prompt_index, delta)
    count_prompts(streams, choices)
    if echo is not None:
        await _echo(choices, streams, *echo)
    return json_response({**meta, "choices": choices.final_choices(), "usage": choices.usage(),
                          **choices.response_fields()})


def usage_mode(req: CompletionRequest | ChatCompletionRequest, force_include_usage: bool) -> str:
    """A stream's usage chunks, as vLLM's ``should_include_usage``: "none", "last" (the final usage chunk) or
    "continuous" (every chunk too); ``include_usage`` left out is true (``stream_options: {}`` asks for usage),
    ``continuous_usage_stats`` counts only with it (`StreamOptions`), and `force_include_usage`
    (--enable-force-include-usage) makes it "continuous" whatever the request asks, as vLLM's."""
    if force_include_usage:
        return "continuous"
    options = req.stream_options
    if options is None or not options.usage:
        return "none"
    return "continuous" if options.continuous else "last"


def chunk_usage(choices: Choices, index: int, usage: str) -> dict[str, Any]:
    """A chunk's ``usage`` field for `usage_mode`'s `usage`: none, null, or choice `index`'s usage so far."""
    if usage == "none":
        return {}
    return {"usage": choices.choice_usage(index) if usage == "continuous" else None}


def count_prompts(streams: list[RequestStream], choices: Choices) -> None:
    """Each prompt's token count (and, with return_token_ids, its ids; with prompt tokens details, its cached
    tokens, known from its first token on; whether it ended the thinking) from its stream, once known."""
    for i, stream in enumerate(streams):
        if stream.collector is not None:
            choices.prompt_tokens[i] = len(stream.collector.prompt_token_ids)
            choices.ended_thinking(i, stream.collector.prompt_token_ids)
            if choices.cached_tokens is not None:
                choices.cached_tokens[i] = stream.collector.num_cached_tokens
            if choices.return_token_ids:
                choices.prompt_token_ids[i] = list(stream.collector.prompt_token_ids)


async def _echo(choices: Choices, streams: list[RequestStream], prompts: list[str | list[int]], tokenizer: Any,
                firsts: list[Any] = ()) -> Echoed:
    """Completions' ``echo``: each prompt (its text, and its logprobs when asked) before its choices.

    Streaming, `firsts` (the streams' first deltas, not yet added) carry the
    prompts' logprobs; the result is the `Echoed` of the first chunks.
    """
    out = []
    for i, (stream, prompt) in enumerate(zip(streams, prompts)):
        if i < len(firsts) and firsts[i].prompt_logprobs is not None:
            choices.prompt_logprobs[i] = firsts[i].prompt_logprobs
        token_ids = stream.collector.prompt_token_ids if stream.collector is not None else []
        if choices.return_token_ids:  # vLLM's: the prompt comes back as prompt_token_ids, not as echoed text
            text = ""
        elif isinstance(prompt, str):
            text = prompt
        elif tokenizer is None:  # --skip-tokenizer-init: no text for ids
            text = ""
        else:  # token ids: their text, decoded off the event loop
            text = await anyio.to_thread.run_sync(tokenizer.decode, token_ids)
        out += [(index, logprobs, text) for index, logprobs in choices.echo(i, text, token_ids)]
    return out


async def _hold_for_prompt_logprobs(streams: list[RequestStream], firsts: list[Any], choices: Choices,
                                    until: Callable[[], Awaitable[object]]) -> list[tuple[int, Any]]:
    """Streaming echo with logprobs and n > 1: every choice's echo starts with its prompt's logprobs, which come
    with sample 0's first delta, and a sibling's may come first. Take such a stream's deltas until they come; the
    ``(stream index, delta)`` taken are sent after the echo, in order (`merge_streams`' ``held``)."""
    held: list[tuple[int, Any]] = []

    async def take(index: int) -> None:
        async for delta in streams[index]:
            held.append((index, delta))
            if delta.prompt_logprobs is not None:
                choices.prompt_logprobs[index] = delta.prompt_logprobs
                return

    waiting = [i for i, first in enumerate(firsts) if first.prompt_logprobs is None]
    if choices.top_logprobs is None or not waiting:
        return held
    try:
        await gather_until([take(i) for i in waiting], until)
    except BaseException:  # an error or a client gone before the response starts: abort them all
        for stream in streams:
            await stream.aclose()
        raise
    return held


async def _sse(request: Request, streams: list[RequestStream], firsts: list[Any], choices: Choices,
               meta: dict[str, Any], usage: str, echoed: Echoed,
               held: list[tuple[int, Any]] = (), steps: dict[int, Any] | None = None,
               constraint: str = "response_format") -> AsyncIterator[bytes]:
    """The chunks; `usage` is "none", "last" (a final usage chunk, null in the others) or "continuous"
    (vLLM's continuous_usage_stats: every chunk has its choice's usage so far, then the final chunk the request's);
    `held`: deltas taken after `firsts` (`_hold_for_prompt_logprobs`), or before any (`accepted_streams`, whose
    pending reads are `steps`); an error of the output constraint names `constraint`, the client's field (a prompt
    list's stream begins before the engine compiled it: `accepted_streams`)."""

    encode = ChunkEncoder(meta)

    def chunk(choice: dict[str, Any], top: dict[str, Any] | None = None) -> bytes:
        if top:
            return sse_event({**meta, **top, "choices": [choice], **chunk_usage(choices, choice["index"], usage)})
        return encode(choice, chunk_usage(choices, choice["index"], usage))

    try:
        with constraint_errors(constraint):  # the engine's ``structured``: the client's field
            if choices.chat:
                for choice, top in _chat_openings(choices):
                    yield chunk(choice, top)
            for index, logprobs, text in echoed:
                yield chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": None,
                             "stop_reason": None, **choices.stream_token_ids(index, [])})
            async for prompt_index, delta in merge_streams(streams, firsts, until=lambda: wait_disconnect(request),
                                                           held=held, steps=steps):
                index, logprobs = choices.add(prompt_index, delta)
                if choices.chat:
                    for choice in chat_stream_choices(choices, index, delta, logprobs):
                        yield chunk(choice)
                elif (delta.text or delta.finish_reason is not None or logprobs is not None
                      or (choices.return_token_ids and delta.token_ids)):
                    text = "" if choices.echo_only else delta.text  # echo with max_tokens 0 drops the generated token
                    finish, stop = choices.finish_of(index) if delta.finish_reason is not None else (None, None)
                    yield chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                 "stop_reason": stop, **choices.stream_token_ids(index, delta.token_ids)})
            if usage != "none":
                # counted again: a prompt list's streams began on acceptance (`accepted_streams`), before their first
                # tokens, and a prompt's cached tokens are known from its first token on
                count_prompts(streams, choices)
                yield sse_event({**meta, "choices": [], "usage": choices.usage()})
    except AsyncLLMError as exc:  # after the first token the status is sent: report in the stream
        yield sse_event(error_body(exc)[1])
    except ClientDisconnected:
        return
    except Exception as exc:  # noqa: BLE001 - a bug: the 500 `guard` answers before the stream, as an event (vLLM's)
        yield sse_event(await _unexpected(request, streams, exc))
    yield b"data: [DONE]\n\n"


async def _unexpected(request: Request, streams: list[RequestStream], exc: Exception) -> dict[str, Any]:
    """A stream's unexpected error (a bug, any exception that is no asyncllm error), after its status was sent:
    logged, its requests aborted (an error in the reading loop leaves `merge_streams` open), and the error body of
    the 500 `guard` answers before a stream."""
    logger.exception("unexpected error in a stream of %s", request.url.path, exc_info=exc)
    for stream in streams:
        await stream.aclose()
    return error_body(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))[1]


class ChunkEncoder:
    """A stream's chunks as `sse_event` writes ``{**meta, "choices": [choice], **usage}``, `meta` (the same in
    every chunk: id, object, created, model) encoded once, not per token."""

    __slots__ = ("_head", "_meta")

    def __init__(self, meta: dict[str, Any]) -> None:
        self._meta = meta
        head = msgspec.json.encode(meta)[:-1]  # '{' and meta's fields, open
        self._head = b"data: " + head + (b',"choices":[' if meta else b'"choices":[')
        if "choices" in meta or "usage" in meta:  # a field the chunk's own would replace: as sse_event
            self._head = None

    def __call__(self, choice: dict[str, Any], usage: dict[str, Any]) -> bytes:
        if self._head is None or len(usage) > 1 or (usage and "usage" not in usage):  # other fields: as sse_event
            return sse_event({**self._meta, "choices": [choice], **usage})
        tail = b"]}\n\n" if not usage else b'],"usage":' + msgspec.json.encode(usage["usage"]) + b"}\n\n"
        return self._head + msgspec.json.encode(choice) + tail


def _chat_openings(choices: Choices) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """A chat stream's first chunks: each choice's role (`Choices.chat_role`; with vLLM's ``return_token_ids``, the
    prompt's ``prompt_token_ids`` at the top), then each choice's echoed last message (vLLM's chat ``echo``)."""
    count = len(choices.prompt_tokens) * choices.n
    top = {"prompt_token_ids": choices.prompt_token_ids[0]} if choices.return_token_ids else {}
    out = [(chat_chunk(index, {"role": choices.chat_role, "content": ""}), top) for index in range(count)]
    if choices.chat_echo:
        out += [(chat_chunk(index, {"content": choices.chat_echo}), {}) for index in range(count)]
    return out


async def response_events(request: Request, events: ResponseEvents, streams: list[RequestStream],
                          firsts: list[Any], choices: Choices) -> AsyncIterator[bytes]:
    """The Responses API's SSE events of one chat completion's stream (responses_api.py)."""
    choices.streaming = True
    for event in events.start():
        yield event
    try:
        async for prompt_index, delta in merge_streams(streams, firsts, until=lambda: wait_disconnect(request)):
            index, _ = choices.add(prompt_index, delta)
            parts, finish_reason = choices.chat_deltas(index, delta.text, delta.finish_reason)
            for event in events.feed(parts):
                yield event
            if finish_reason is not None:
                for event in events.finish(finish_reason, choices.usage(reasoning_tokens=True)):
                    yield event
    except AsyncLLMError as exc:  # after the first event the status is sent: report in the stream
        yield events.error(error_body(exc)[1]["error"])
    except ClientDisconnected:
        return
    except Exception as exc:  # noqa: BLE001 - a bug: as `_sse`'s, an error event that ends the stream
        yield events.error((await _unexpected(request, streams, exc))["error"])
