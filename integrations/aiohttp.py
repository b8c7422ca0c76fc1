"""aiohttp: the engine in an `aiohttp.web.Application`, and a streaming handler.

::

    app = web.Application()
    setup_engine(app, AsyncEngine("path/or/hub-id"))      # starts with the app, closes at cleanup

    async def handler(request):
        engine = request.app[ENGINE_KEY]
        return await stream_text(request, engine.stream(prompt, params))

`create_app(engine)` builds a ready app with ``POST /generate`` (JSON in,
streamed text out). A client that disconnects aborts its request, whether it
is queued, generating, or its next write fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Any

from aiohttp import web

from asyncllm.errors import AsyncLLMError, InvalidRequestError
from asyncllm.integrations.errors import error_body, renamed_error, renamed_fields, text_stream_end
from asyncllm.integrations.streams import (
    TEXT_STREAM_HEADERS, ClientDisconnected, check_not_aborted, check_one_sample, first_deltas, merge_streams,
)
from asyncllm.sampling import SamplingParams

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.stream import RequestStream

__all__ = ["ENGINE_KEY", "setup_engine", "stream_text", "wait_disconnect", "generate_handler", "create_app"]

ENGINE_KEY: web.AppKey[Any] = web.AppKey("asyncllm_engine")
"""``request.app[ENGINE_KEY]`` is the engine that `setup_engine` registered."""


def setup_engine(app: web.Application, engine: AsyncEngine, *, close: bool = True) -> None:
    """Register `engine` on `app`: started on app startup, closed on cleanup (unless `close=False`)."""
    app[ENGINE_KEY] = engine

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await engine.start()
        yield
        if close:
            await engine.aclose()

    app.cleanup_ctx.append(lifecycle)


async def stream_text(request: web.Request, stream: RequestStream, *,
                      content_type: str = "text/plain") -> web.StreamResponse:
    """Write the generated text as chunks as it comes.

    The first delta is awaited before the status line goes out, so a bad
    prompt or an overloaded engine becomes a 400 / 429 JSON error, not a
    broken 200 stream; an error after it (or an abort) aborts the request and
    ends the text with a line of its JSON error body (`text_stream_end`). A
    client that disconnects, while its request is queued or between tokens,
    aborts the request. A HEAD request (a GET route answers HEAD too) gets the
    status and headers its GET would, decided by the first delta, and no body:
    the request is aborted there, not generated to its end.
    """
    return await _stream_text(request, stream, content_type, {})


async def _stream_text(request: web.Request, stream: RequestStream, content_type: str,
                       renames: dict[str, str]) -> web.StreamResponse:
    """`stream_text`, its errors naming the client's fields (`renames`, as `renamed_fields`)."""
    until = partial(wait_disconnect, request)
    async with stream:
        try:
            check_one_sample(stream)
            firsts = await first_deltas([stream], until=until)
            check_not_aborted(firsts[0])  # before its first token (a queued request, the engine closing)
        except AsyncLLMError as exc:
            return _error(_as_sent(exc, renames))
        except ClientDisconnected:
            return web.Response(status=499)  # nobody reads it: aiohttp logs the early disconnect at debug level
        if "charset=" not in content_type.lower():  # the text is UTF-8; one given already is kept, not doubled
            content_type = f"{content_type}; charset=utf-8"
        response = web.StreamResponse(headers={"Content-Type": content_type, **TEXT_STREAM_HEADERS})
        if request.method == "HEAD":  # GET's status and headers, no body: the request is aborted on leaving
            return response
        try:
            await response.prepare(request)
            try:
                async with aclosing(merge_streams([stream], firsts, until=until)) as deltas:
                    async for _, delta in deltas:
                        if delta.text:
                            await response.write(delta.text.encode())
                        check_not_aborted(delta)
            except (ClientDisconnected, ConnectionResetError):
                raise
            except Exception as exc:  # noqa: BLE001 - after the status line: the stream's last line says it
                await stream.aclose()
                await response.write(text_stream_end(_as_sent(exc, renames)).encode())
            await response.write_eof()
        except (ClientDisconnected, ConnectionResetError):  # an ordinary disconnect: abort, no traceback
            pass
        return response


async def wait_disconnect(request: web.Request, interval: float = 0.25) -> None:
    """Return when the client's connection is gone (aiohttp has no event for it: polled every `interval` s, a
    wake-up per open request; 0.25 s costs about 1.5% of a core per 1,000 streams)."""
    while request.transport is not None and not request.transport.is_closing():
        await asyncio.sleep(interval)


async def generate_handler(request: web.Request) -> web.StreamResponse:
    """``POST {"prompt": str, ...SamplingParams fields}`` -> the completion's text, streamed."""
    try:
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise InvalidRequestError("prompt", "send a JSON object with a string 'prompt'")
        prompt = body.pop("prompt")
        renames = _structured_as_sent(body)
        with renamed_fields(renames):
            params = SamplingParams(**body)
    except AsyncLLMError as exc:
        return _error(exc)
    except (ValueError, TypeError) as exc:  # bad JSON, an unknown SamplingParams field
        return _error(InvalidRequestError("body", str(exc)))
    return await _stream_text(request, request.app[ENGINE_KEY].stream(prompt, params), "text/plain", renames)


def _structured_as_sent(body: dict[str, Any]) -> dict[str, str]:
    """The engine's ``structured`` -> the name the body gave the constraint (vLLM's ``structured_outputs``, older
    vLLM's ``guided_decoding``), for its errors, the host's checks and the core's compile alike."""
    given = [name for name in ("structured", "structured_outputs", "guided_decoding") if body.get(name) is not None]
    return {"structured": given[0]} if given and given[0] != "structured" else {}


def _as_sent(exc: Exception, renames: dict[str, str]) -> Exception:
    """`exc`, an `InvalidRequestError` naming the client's field (`renames`)."""
    return renamed_error(exc, renames) if isinstance(exc, InvalidRequestError) else exc


def create_app(engine: AsyncEngine | None = None) -> web.Application:
    """An app with ``POST /generate``; `engine` defaults to the bundled tiny model."""
    if engine is None:
        from asyncllm import AsyncEngine

        engine = AsyncEngine(disable_log_stats=True)
    app = web.Application()
    setup_engine(app, engine)
    app.router.add_post("/generate", generate_handler)
    return app


def _error(exc: AsyncLLMError) -> web.Response:
    status, body, headers = error_body(exc)
    return web.json_response(body, status=status, headers=headers)
