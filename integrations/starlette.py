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
from starlette.responses import StreamingResponse

from asyncllm.integrations.streams import ClientDisconnected, merge_streams

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.stream import RequestStream

__all__ = ["engine_lifespan", "get_engine", "text_stream_response", "wait_disconnect"]


def engine_lifespan(engine: AsyncEngine, *, close: bool = True
                    ) -> Callable[[Any], AbstractAsyncContextManager[dict[str, Any]]]:
    """A ``lifespan=`` for Starlette/FastAPI: start `engine` at startup, close it at shutdown.

    The engine is put in the lifespan state, so handlers reach it as
    ``request.state.engine`` (or `get_engine(request)`, a FastAPI dependency too).
    `close=False` leaves it running (an engine shared with something else).
    """

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[dict[str, Any]]:
        await engine.start()
        try:
            yield {"engine": engine}
        finally:
            if close:
                await engine.aclose()

    return lifespan


def get_engine(request: Request) -> AsyncEngine:
    """The engine of `engine_lifespan`; use as ``Depends(get_engine)`` in FastAPI."""
    return request.state.engine


async def wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (call once the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def text_stream_response(stream: RequestStream, request: Request | None = None, *,
                         media_type: str = "text/plain; charset=utf-8") -> StreamingResponse:
    """Stream the generated text as it comes; a client that leaves aborts the request."""

    async def body() -> AsyncIterator[str]:
        until = (lambda: wait_disconnect(request)) if request is not None else None
        try:
            async for _, delta in merge_streams([stream], until=until):
                if delta.text:
                    yield delta.text
        except ClientDisconnected:
            return

    return StreamingResponse(body(), media_type=media_type)
