"""Django (ASGI): one lazily started engine per process, and streaming async views.

Django has no lifespan hook, so the engine is made on first use from the
``ASYNCLLM`` setting (``{"model": "path/or/hub-id", **EngineConfig fields}``;
no setting: the bundled tiny model) and starts with its first request::

    from asyncllm.integrations.django import get_engine, stream_response

    async def complete(request):
        return await stream_response(get_engine().stream(request.GET["prompt"], SamplingParams(max_tokens=64)),
                                     request)

Serve the project with an ASGI server (uvicorn, daphne, granian): under WSGI
Django runs each async view on a fresh event loop, closed after it, and reads an
async response body on yet another loop, where the engine's stream cannot follow;
so given a WSGI request, `stream_response` reads the whole text in the view and
answers it at once. The engine moves to the next loop once the one before closed
(the sync test Client, one WSGI request at a time), but `get_engine` refuses a
second loop while the first is still open (concurrent WSGI requests) with a clear
error.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from asyncllm.errors import AsyncLLMError
from asyncllm.integrations.errors import error_body, text_stream_end
from asyncllm.integrations.streams import TEXT_STREAM_HEADERS, check_not_aborted, check_one_sample, empty_body

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.stream import RequestStream
    from asyncllm.outputs import StreamDelta

__all__ = ["get_engine", "use_engine", "stream_response", "error_response", "close_engine"]

_lock = threading.Lock()
_engine: AsyncEngine | None = None
_loop: asyncio.AbstractEventLoop | None = None


def get_engine() -> AsyncEngine:
    """This process's engine, made from ``settings.ASYNCLLM`` on first call (it starts on first request)."""
    global _engine, _loop
    loop = _running_loop()
    with _lock:
        if _engine is None:
            _engine = _make_engine()
        if loop is not None:
            if _loop is None or not _engine.started or _loop.is_closed():
                _loop = loop  # the loop the engine (re)starts on, or takes it over on (the one before closed)
            elif loop is not _loop:
                raise ImproperlyConfigured(
                    "asyncllm's engine was started on another event loop: serve Django with ASGI "
                    "(uvicorn/daphne), not WSGI, so that async views share one loop",
                )
        return _engine


def use_engine(engine: AsyncEngine | None) -> None:
    """Make `engine` this process's engine instead of one made from settings
    (e.g. ``AsyncEngine.connect()`` to share a standalone core between Django workers);
    None forgets it (without closing it), so the next `get_engine` reads the settings again."""
    global _engine, _loop
    with _lock:
        _engine, _loop = engine, None


async def close_engine() -> None:
    """Close the process's engine (tests, or a shutdown hook); the next `get_engine` makes a new one."""
    global _engine, _loop
    with _lock:
        engine, _engine, _loop = _engine, None, None
    if engine is not None:
        await engine.aclose()


async def stream_response(stream: RequestStream, request: HttpRequest | None = None, *,
                          content_type: str = "text/plain; charset=utf-8"
                          ) -> StreamingHttpResponse | HttpResponse | JsonResponse:
    """A `StreamingHttpResponse` of the generated text (await it in an async view, passing its `request`).

    The first delta is awaited first, so a bad prompt or an overloaded engine
    is a 400 / 429 JSON error, not a broken 200; an error after it (or an abort) aborts the request and ends the
    text with a line of its JSON error body (`text_stream_end`). Django's ASGI handler stops
    the iterator when the client disconnects, which leaves the stream and
    aborts the request. A WSGI `request` (a WSGI server, the sync test Client) gets the whole text in one
    `HttpResponse`: Django would read a streamed body on another event loop, where the stream cannot go. A HEAD
    `request` (a GET view answers HEAD too) gets the status and headers its GET would, decided by the first delta,
    and no body: the request is aborted there, not generated to its end.
    """
    try:
        check_one_sample(stream)
        first = await stream.__anext__()
        check_not_aborted(first)  # before its first token (a queued request, the engine closing)
        if request is not None and request.method == "HEAD":  # GET's status and headers, no body
            await stream.aclose()  # aborted, not generated to its end (the server would drop the text)
            return _with_stream_headers(StreamingHttpResponse(empty_body() if _asgi(request) else iter(()),
                                                              content_type=content_type))
        if request is not None and not _asgi(request):
            return HttpResponse(await _whole(stream, first), content_type=content_type)
    except AsyncLLMError as exc:
        await stream.aclose()
        return error_response(exc)
    return _with_stream_headers(StreamingHttpResponse(_text(stream, first), content_type=content_type))


def _with_stream_headers(response: StreamingHttpResponse) -> StreamingHttpResponse:
    for name, value in TEXT_STREAM_HEADERS.items():
        response[name] = value
    return response




def _asgi(request: HttpRequest) -> bool:
    from django.core.handlers.asgi import ASGIRequest

    return isinstance(request, ASGIRequest)


async def _whole(stream: RequestStream, first: StreamDelta) -> str:
    """The whole text; `RequestAbortedError` for an aborted request, which would pass for a whole text."""
    async with stream:
        texts = [first.text]
        async for delta in stream:
            texts.append(delta.text)
            check_not_aborted(delta)
        return "".join(texts)


def error_response(exc: AsyncLLMError) -> JsonResponse:
    status, body, headers = error_body(exc)
    response = JsonResponse(body, status=status)
    for name, value in headers.items():
        response[name] = value
    return response


async def _text(stream: RequestStream, first: StreamDelta) -> AsyncIterator[str]:
    async with stream:  # however the iteration ends, the request is aborted if unfinished
        try:
            if first.text:
                yield first.text
            async for delta in stream:
                if delta.text:
                    yield delta.text
                check_not_aborted(delta)
        except Exception as exc:  # noqa: BLE001 - after the status line: the stream's last line says it
            await stream.aclose()
            yield text_stream_end(exc)


def _make_engine() -> AsyncEngine:
    from asyncllm import AsyncEngine

    options: dict[str, Any] = dict(getattr(settings, "ASYNCLLM", None) or {})
    model = options.pop("model", None)
    return AsyncEngine(model, **options)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
