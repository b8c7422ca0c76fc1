"""`asyncllm serve`'s shutdown: the first SIGINT/SIGTERM closes the engine, so open streams end and uvicorn's wait
for open connections ends (asyncllm/cli_serve.py)."""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from asyncllm.cli_serve import _start_and_serve
from asyncllm.serve_drain import RequestGate


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
        gate = RequestGate(_app(engine, streaming, ends_in=0.3))
        server = uvicorn.Server(uvicorn.Config(gate, log_level="warning"))
        serving = asyncio.create_task(_start_and_serve(None, engine, server, sock, None, drain, gate))
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
        assert ends in body and engine.closes[0] == (False, None), (body, engine.closes)  # (the gate drained)
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
        if scope["path"].endswith("/health"):  # (under a root path too)
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
    when the signal comes is answered, the engine's close waits for it and no longer; a new request during the drain
    (on a connection still open: uvicorn closed its listening socket) is 503, /health is not, under a root path too
    (nor does it hold the drain)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    async def main() -> tuple[bytes, list[int], float, _Engine]:
        engine, reading = _Engine(), asyncio.Event()
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello"
        app = _slow_body_app(engine, reading)
        gate, serving, (reader, writer) = await _serve_gated(app, engine, sock, 5.0, request)
        await reading.wait()
        signal.raise_signal(signal.SIGINT)  # the drain begins while the body is still coming
        await asyncio.sleep(0.05)
        statuses = [await _status(gate, path, root) for path, root in
                    (("/v1/chat/completions", ""), ("/health", ""), ("/api/health", "/api"))]
        writer.write(b"world")
        answered = asyncio.get_running_loop().time()
        await asyncio.wait_for(serving, 10)
        took = asyncio.get_running_loop().time() - answered  # the drain ends with its last request, not at 5 s
        body = await reader.read()
        writer.close()
        return body, statuses, took, engine

    try:
        body, statuses, took, engine = asyncio.run(main())
        assert body.startswith(b"HTTP/1.1 200") and b"helloworld" in body, body
        assert statuses == [503, 200, 200] and engine.closes == [(False, None)] * 2, (statuses, engine.closes)
        assert took < 1.5, took
    finally:
        sock.close()


async def _serve_gated(app, engine: _Engine, sock: socket.socket, drain: float, request: bytes) -> tuple:
    """`asyncllm serve` of `app` in a `RequestGate` on `sock` with ``--shutdown-timeout drain``, once uvicorn started
    sent `request` on a new connection: the gate, the serving task and the connection's (reader, writer)."""
    import uvicorn


    gate = RequestGate(app)
    server = uvicorn.Server(uvicorn.Config(gate, log_level="warning"))
    serving = asyncio.create_task(_start_and_serve(None, engine, server, sock, None, drain, gate))
    while not server.started:
        await asyncio.sleep(0.01)
    reader, writer = await asyncio.open_connection(*sock.getsockname())
    writer.write(request)
    return gate, serving, (reader, writer)


async def _status(app, path: str, root_path: str = "") -> int:
    """The status `app` answers a GET of `path` with (an ASGI call, as the server makes one)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "method": "GET", "path": path, "root_path": root_path, "headers": []}, receive, send)
    return sent[0]["status"]


def test_a_drain_ends_at_its_timeout_and_the_close_aborts_what_is_left() -> None:
    """A request that outlives ``--shutdown-timeout N`` (0.3 s here): the drain ends after N s, the engine's close
    ends its stream ("abort")."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    async def main() -> tuple[bytes, float, _Engine]:
        engine, streaming = _Engine(), asyncio.Event()
        _, serving, (reader, writer) = await _serve_gated(_app(engine, streaming), engine, sock, 0.3,
                                                          b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await streaming.wait()
        signalled = asyncio.get_running_loop().time()
        signal.raise_signal(signal.SIGINT)
        await asyncio.wait_for(serving, 10)
        took = asyncio.get_running_loop().time() - signalled
        body = await reader.read()
        writer.close()
        return body, took, engine

    try:
        body, took, engine = asyncio.run(main())
        assert b"data: abort" in body and 0.3 <= took < 2 and engine.closes[0] == (False, None), (body, took)
    finally:
        sock.close()


def test_a_drain_cancelled_still_closes_the_engine() -> None:
    """The close's task cancelled during the gate's drain (its request never ends): the engine is closed all the
    same."""
    from types import SimpleNamespace

    from asyncllm.cli_serve import _close_engine_on_exit

    async def main() -> _Engine:
        engine = _Engine()
        gate = RequestGate(_app(engine, asyncio.Event()))
        gate.in_flight = 1  # a request that does not end
        server = SimpleNamespace(handle_exit=lambda sig, frame: None)
        closing = _close_engine_on_exit(server, engine, 5.0, gate)
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(0.05)
        closing[0].cancel()
        await asyncio.gather(closing[0], return_exceptions=True)
        return engine

    assert asyncio.run(main()).closed.is_set()


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
        gate = RequestGate(_app(_Hanging(), asyncio.Event()))
        server = uvicorn.Server(uvicorn.Config(gate, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(_start_and_serve(None, _Hanging(), server, sock, None, 0.0, gate))
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
