"""Starlette / FastAPI: a lifespan that owns the engine, and streaming responses.

::

    engine = AsyncEngine("path/or/hub-id")
    app = Starlette(routes=[...], lifespan=engine_lifespan(engine))   # or FastAPI(lifespan=...)

    async def complete(request):
        engine = get_engine(request)
        return text_stream_response(engine.stream(prompt, params), request)

The engine starts with the app (so the first request is not slow and a broken
model fails the deploy, not a user's request) and is closed at shutdown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from asyncllm.errors import AsyncLLMError
from asyncllm.integrations.errors import error_body, text_stream_end
from asyncllm.integrations.streams import (
    TEXT_STREAM_HEADERS, ClientDisconnected, check_not_aborted, check_one_sample, empty_body, first_deltas,
    merge_streams,
)

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.stream import RequestStream
    from asyncllm.outputs import StreamDelta

__all__ = ["engine_lifespan", "get_engine", "text_stream_response", "wait_disconnect"]


def engine_lifespan(engine: AsyncEngine | Callable[[], AsyncEngine], *, close: bool = True
                    ) -> Callable[[Any], AbstractAsyncContextManager[dict[str, Any]]]:
    """A ``lifespan=`` for Starlette/FastAPI: start `engine` at startup, close it at shutdown.

    The engine is put in the lifespan state, so handlers reach it as
    ``request.state.engine`` (or `get_engine(request)`, a FastAPI dependency too).
    `close=False` leaves it running (an engine shared with something else). A closed engine never starts again,
    so an app started more than once (a ``TestClient`` per test) gives a factory instead (``AsyncEngine`` itself,
    or ``lambda: AsyncEngine(model, ...)``): each startup makes its own engine.
    """

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[dict[str, Any]]:
        served = engine if _is_engine(engine) else engine()  # type: ignore[operator]
        await served.start()
        try:
            yield {"engine": served}
        finally:
            if close:
                await served.aclose()

    return lifespan


def _is_engine(value: object) -> bool:
    """An engine (anything with ``start``), not a factory of one."""
    return hasattr(value, "start") and not isinstance(value, type)


def get_engine(request: Request) -> AsyncEngine:
    """The engine of `engine_lifespan`; use as ``Depends(get_engine)`` in FastAPI."""
    return request.state.engine


async def wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (call once the body has been read)."""
    await _disconnected(request.receive)


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def text_stream_response(stream: RequestStream, request: Request | None = None, *,
                         media_type: str = "text/plain; charset=utf-8") -> StreamingResponse:
    """Stream the generated text as it comes; a client that leaves aborts the request.

    The first delta is awaited before the status line goes out, so a bad prompt
    or an overloaded engine is a 400 / 429 JSON error, not a broken 200 stream;
    an error after it (or an abort) aborts the request and ends the text with a
    line of its JSON error body (`text_stream_end`). A client that disconnects
    is noticed even while its request is queued or between tokens (`request`
    is optional: the response listens to the connection it is sent on). A HEAD request (a GET route answers HEAD
    too) gets the status and headers its GET would, decided by the first delta, and no body: the request is aborted
    there, not generated to its end (the server would drop the text).
    """
    return _TextStreamResponse(stream, request, media_type)


class _TextStreamResponse(StreamingResponse):
    """Sends its status only once the first delta (or the error instead of it) has come."""

    def __init__(self, stream: RequestStream, request: Request | None, media_type: str) -> None:
        # the body runs once __call__ has the first delta
        super().__init__(self._text(), media_type=media_type, headers=TEXT_STREAM_HEADERS)
        self._stream = stream
        self._until = (lambda: wait_disconnect(request)) if request is not None else None
        self._firsts: list[StreamDelta] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._until is None:  # no request given: the response's own receive (a queued request's client too)
            self._until = lambda: _disconnected(receive)
        try:
            check_one_sample(self._stream)
            self._firsts = await first_deltas([self._stream], until=self._until)
            check_not_aborted(self._firsts[0])  # before its first token (a queued request, the engine closing)
        except AsyncLLMError as exc:
            await self._stream.aclose()
            status, body, headers = error_body(exc)
            await JSONResponse(body, status, headers)(scope, receive, send)
            return
        except ClientDisconnected:  # its request is aborted; nobody reads the status
            await Response(status_code=499)(scope, receive, send)
            return
        if scope.get("method") == "HEAD":  # GET's status and headers, no body: not generated to its end
            await self._stream.aclose()
            self.body_iterator = empty_body()
        try:
            await super().__call__(scope, receive, send)
        finally:  # Starlette drops the body iterator unclosed when a send fails: abort now, not at a GC pass
            await self._stream.aclose()

    async def _text(self) -> AsyncIterator[str]:
        try:
            async for _, delta in merge_streams([self._stream], self._firsts, until=self._until):
                if delta.text:
                    yield delta.text
                check_not_aborted(delta)
        except ClientDisconnected:
            return
        except Exception as exc:  # noqa: BLE001 - after the status line: the stream's last line says it
            await self._stream.aclose()
            yield text_stream_end(exc)


