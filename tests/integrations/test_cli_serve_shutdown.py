"""`asyncllm serve`'s shutdown: the first SIGINT/SIGTERM closes the engine, so open streams end and uvicorn's wait
for open connections ends (asyncllm/cli_serve.py)."""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from asyncllm.cli_serve import _start_and_serve


class _Engine:
    """An engine whose streams end only when it is closed (as queued streams end at `aclose`)."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.idle = asyncio.Event()  # its streams ended by themselves
        self.closes: list[tuple[bool, float | None]] = []

    async def start(self) -> None:
        pass

    async def aclose(self, drain: bool = False, timeout: float | None = None) -> None:
        """As `AsyncEngine.aclose`: with `drain`, what is in flight runs on for up to `timeout` seconds first."""
        self.closes.append((drain, timeout))
        if drain:
            await asyncio.wait([asyncio.ensure_future(self.idle.wait())], timeout=timeout)
        self.closed.set()


def _app(engine: _Engine, streaming: asyncio.Event, ends_in: float | None = None):
    """A stream that ends when the engine closes ("abort"), or by itself after `ends_in` seconds ("done")."""
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await engine.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        streaming.set()
        closed = asyncio.ensure_future(engine.closed.wait())
        await asyncio.wait([closed], timeout=ends_in)
        engine.idle.set()
        await send({"type": "http.response.body", "body": b"data: abort\n\n" if closed.done() else b"data: done\n\n"})
    return app


@pytest.mark.parametrize(("drain", "ends"), [(0.0, b"data: abort"), (5.0, b"data: done")])
def test_a_signal_closes_the_engine_so_open_streams_end(drain: float, ends: bytes) -> None:
    """``--shutdown-timeout`` as vLLM's: 0 aborts the streams in flight at once, N drains (they run on, up to N s)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]

    async def main() -> tuple[bytes, _Engine]:
        engine, streaming = _Engine(), asyncio.Event()
        server = uvicorn.Server(uvicorn.Config(_app(engine, streaming, ends_in=0.3), log_level="warning"))
        serving = asyncio.create_task(_start_and_serve(None, engine, server, sock, None, drain))
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await streaming.wait()
        signal.raise_signal(signal.SIGINT)  # uvicorn's handler, then the engine's close
        await asyncio.wait_for(serving, 10)  # without the close: uvicorn waits for the stream with no limit
        body = await reader.read()
        writer.close()
        return body, engine

    try:
        body, engine = asyncio.run(main())
        assert ends in body and engine.closes[0] == ((True, drain) if drain else (False, None)), (body, engine.closes)
    finally:
        sock.close()


@pytest.fixture(autouse=True)
def _quiet_sigint():
    """SIGINT a no-op: uvicorn raises it again to the handler it found once it stopped (pytest's ends the run)."""
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_started_server_freezes_its_startup_heap(monkeypatch) -> None:
    """asyncllm/engine/heap.py: once the engine started, the server's objects leave the collector's oldest
    generation (vLLM's gc.freeze after its start)."""
    import gc

    from asyncllm.cli_serve import _start
    from asyncllm.engine import heap

    monkeypatch.setattr(heap, "_frozen", False)
    gc.unfreeze()
    try:
        asyncio.run(_start(None, _Engine()))
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
