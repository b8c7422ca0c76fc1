"""One close at shutdown: concurrent `AsyncEngine.aclose` calls share one stop of the core(s), each returning once it
ended, a cancelled one too, before its cancellation goes on; `asyncllm serve` ends by a SIGTERM only once the engine's close ended (asyncllm/cli_serve.py)."""

from __future__ import annotations

import asyncio
import signal
import time

import uvicorn

from asyncllm.cli import _parser
from asyncllm.engine import async_engine
from asyncllm.engine.async_engine import AsyncEngine


def _started_engine(monkeypatch, tiny_llama) -> tuple[AsyncEngine, list[str]]:
    """An engine `_close` reads as started, whose stop takes a while; what happened is in the list."""
    events: list[str] = []

    async def stop_all(replicas, retire=False) -> None:
        events.append("stop begins")
        await asyncio.sleep(0.05)
        events.append("stop ends")

    monkeypatch.setattr(async_engine, "stop_all", stop_all)
    engine = AsyncEngine(tiny_llama)
    engine._started, engine._forgotten = True, lambda: None
    engine._forgotten.detach = lambda: events.append("finalizer detached")
    return engine, events


def test_concurrent_acloses_stop_the_engine_once_and_each_returns_once_it_stopped(monkeypatch, tiny_llama) -> None:
    engine, events = _started_engine(monkeypatch, tiny_llama)

    async def main() -> list[list[str]]:
        seen: list[list[str]] = []

        async def close() -> None:
            await engine.aclose()
            seen.append([event for event in events if event.startswith("stop")])  # stopped when this one returned

        await asyncio.gather(close(), close(), close())
        return seen

    assert asyncio.run(main()) == [["stop begins", "stop ends"]] * 3


def test_a_closed_loops_unfinished_stop_leaves_a_later_aclose_to_return(monkeypatch, tiny_llama) -> None:
    """An aclose whose loop closed mid-stop (its stop task never ends there) is no stop a later loop's aclose can
    wait for: that aclose returns at once, raising nothing."""
    begun: list[str] = []

    async def stop_all(replicas, retire=False) -> None:
        begun.append("stop")
        await asyncio.get_running_loop().create_future()  # never ends

    monkeypatch.setattr(async_engine, "stop_all", stop_all)
    engine = AsyncEngine(tiny_llama)
    engine._started, engine._forgotten = True, lambda: None  # a started engine, as far as `_close` reads
    engine._forgotten.detach = lambda: None
    first = asyncio.new_event_loop()
    closing = first.create_task(engine.aclose())
    first.run_until_complete(asyncio.sleep(0.01))  # the stop began, and waits on
    first.close()
    assert begun == ["stop"] and not (closing.done() or engine._stopping.done())

    async def later() -> None:
        await asyncio.wait_for(engine.aclose(), 5)

    asyncio.run(later())
    assert begun == ["stop"]  # never stopped twice


def test_an_aclose_cancelled_before_its_stop_began_stops_the_engine_then_raises(monkeypatch, tiny_llama) -> None:
    engine, events = _started_engine(monkeypatch, tiny_llama)

    async def main() -> None:
        closing = asyncio.create_task(engine.aclose())
        second = asyncio.create_task(engine.aclose())  # a concurrent one, not cancelled
        await asyncio.sleep(0)  # the first is at its stop, whose task has not run a step yet
        closing.cancel()
        first, other = await asyncio.gather(closing, second, return_exceptions=True)
        assert isinstance(first, asyncio.CancelledError) and other is None
        events.append("both returned")
        await engine.aclose()  # stopped: never twice

    asyncio.run(main())
    assert events == ["stop begins", "stop ends", "finalizer detached", "finalizer detached", "both returned"]


def test_a_stop_cancelled_before_it_began_is_no_stop(monkeypatch, tiny_llama) -> None:
    """`asyncio.run`'s end cancels every task, the stop's too: the finalizer stays, and a later aclose stops."""
    engine, events = _started_engine(monkeypatch, tiny_llama)

    async def main() -> None:
        closing = asyncio.create_task(engine.aclose())
        await asyncio.sleep(0)
        engine._stopping.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        assert events == [] and closing.cancelled()
        await engine.aclose()

    asyncio.run(main())
    assert events == ["stop begins", "stop ends", "finalizer detached"]


def test_a_stop_cancelled_after_it_began_is_the_stop(tiny_llama) -> None:
    """A cancel let into the stop's task once its thread runs (`asyncio.run`'s end): the stop ends, then the cancel is
    raised; the replicas are left holding nothing, the finalizer is detached, and no later aclose stops again."""
    events: list[str] = []
    engine = AsyncEngine(tiny_llama)
    engine._started, engine._forgotten = True, lambda: None
    engine._forgotten.detach = lambda: events.append("finalizer detached")
    replica = engine._replicas[0]
    replica.processor = replica.core = object()  # what `stop_all` must drop

    def stop() -> None:
        events.append("stop begins")
        time.sleep(0.1)
        events.append("stop ends")

    replica.stop = stop  # (the real `stop_all` calls it in its thread)

    async def main() -> None:
        closing = asyncio.create_task(engine.aclose())
        while not events:
            await asyncio.sleep(0.005)  # the stop's thread runs
        engine._stopping.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        assert events == ["stop begins", "stop ends", "finalizer detached"] and closing.cancelled()
        await engine.aclose()

    asyncio.run(main())
    assert events == ["stop begins", "stop ends", "finalizer detached"]
    assert replica.processor is None and replica.core is None


class _Engine:
    """An engine whose close takes a while."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        self.events.append("close begins")
        await asyncio.sleep(0.05)
        self.events.append("closed")


async def _app(scope, receive, send) -> None:
    raise AssertionError("nothing is served")


def test_sigterm_ends_serve_only_once_the_engines_close_ended(monkeypatch, tmp_path) -> None:
    events: list[str] = []

    async def serve(self, sockets=None) -> None:  # uvicorn's: a SIGTERM stops it, then it re-raises the signal
        self.started = True
        self.handle_exit(signal.SIGTERM, None)  # serve's wrapper: uvicorn's stop, and the engine's close
        await asyncio.sleep(0.01)  # the close began
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

    monkeypatch.setattr(uvicorn.Server, "serve", serve)
    monkeypatch.setattr(signal, "raise_signal", lambda signum: events.append(f"ends by {signum!r}"))
    from asyncllm import cli_serve

    parser, path = _parser(), str(tmp_path / "s.sock")
    args = parser.parse_args(["serve", "--uds", path])
    before = signal.getsignal(signal.SIGTERM)
    try:
        with cli_serve.bound_socket(args, parser) as sock:
            cli_serve.serve_app(_app, _Engine(events), sock, args, parser)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert events == ["close begins", "closed", f"ends by {signal.SIGTERM!r}"]
