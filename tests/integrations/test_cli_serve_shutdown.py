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


async def _lifespan(engine: _Engine, receive, send) -> None:
    """As the OpenAI app's: the engine closed at shutdown."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await engine.aclose()
    await send({"type": "lifespan.shutdown.complete"})


def _app(engine: _Engine, streaming: asyncio.Event, ends_in: float | None = None):
    """A stream that ends when the engine closes ("abort"), or by itself after `ends_in` seconds ("done")."""
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(engine, receive, send)
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


def _slow_body_app(engine: _Engine, reading: asyncio.Event):
    """A request that reads its body (sent slowly), then calls the engine, refused once it closes or drains."""
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(engine, receive, send)
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        reading.set()
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        refused = engine.closed.is_set() or any(drain for drain, _ in engine.closes)  # the engine's 503
        await send({"type": "http.response.start", "status": 503 if refused else 200, "headers": []})
        await send({"type": "http.response.body", "body": b"refused" if refused else body})
    return app


def test_a_drain_waits_for_requests_accepted_before_it_and_refuses_new_ones() -> None:
    """``--shutdown-timeout N`` counts a request from its acceptance (serve_drain.py): one still sending its body
    when the signal comes is answered, the engine's close waits for it; a new request during the drain is 503,
    /health is not (nor does it hold the drain)."""
    import uvicorn

    from asyncllm.serve_drain import RequestGate

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]

    async def main() -> tuple[bytes, list[int], _Engine]:
        engine, reading = _Engine(), asyncio.Event()
        gate = RequestGate(_slow_body_app(engine, reading))
        server = uvicorn.Server(uvicorn.Config(gate, log_level="warning"))
        serving = asyncio.create_task(_start_and_serve(None, engine, server, sock, None, 5.0, gate))
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello")
        await reading.wait()
        signal.raise_signal(signal.SIGINT)  # the drain begins while the body is still coming
        await asyncio.sleep(0.05)
        statuses = [await _status(gate, path) for path in ("/v1/chat/completions", "/health")]
        writer.write(b"world")
        await asyncio.wait_for(serving, 10)
        body = await reader.read()
        writer.close()
        return body, statuses, engine

    try:
        body, statuses, engine = asyncio.run(main())
        assert body.startswith(b"HTTP/1.1 200") and b"helloworld" in body, body
        assert statuses == [503, 200] and engine.closes == [(False, None)] * 2, (statuses, engine.closes)
    finally:
        sock.close()


async def _status(app, path: str) -> int:
    """The status `app` answers a GET of `path` with (an ASGI call, as the server makes one)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "method": "GET", "path": path, "root_path": "", "headers": []}, receive, send)
    return sent[0]["status"]


def test_a_close_cut_by_ctrl_c_still_puts_back_the_sigterm_handler() -> None:
    """A second Ctrl-C cancels the wait for the engine's close: SIGTERM's handler is the one found before all the
    same (else a later SIGTERM would be noted and ignored)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    before = signal.getsignal(signal.SIGTERM)

    class _Hanging(_Engine):
        async def aclose(self, drain: bool = False, timeout: float | None = None) -> None:
            await asyncio.Event().wait()  # a close that does not end

    async def main() -> None:
        server = uvicorn.Server(uvicorn.Config(_app(_Hanging(), asyncio.Event()), log_level="warning", lifespan="off"))
        serving = asyncio.create_task(_start_and_serve(None, _Hanging(), server, sock, None))
        while not server.started:
            await asyncio.sleep(0.01)
        signal.raise_signal(signal.SIGINT)
        await asyncio.sleep(0.3)  # uvicorn stopped; its close is waited for
        assert not serving.done() and signal.getsignal(signal.SIGTERM) is not before
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving

    try:
        asyncio.run(main())
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, before)
        sock.close()
