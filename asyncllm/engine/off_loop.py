"""Blocking steps of an engine's start and stop, run off the event loop in threads of their own.

Never in asyncio's default executor: it refuses work once the interpreter began to exit, so an engine closed from
an ``atexit`` handler (``atexit.register(sync_engine.close)``, ``asyncio.run(engine.aclose())``) stopped nothing
and raised "cannot schedule new futures after interpreter shutdown". Where no thread can be started at all
(Python 3.12+ during interpreter shutdown) the step runs inline, blocking the loop, which only closes then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["finish_in_thread", "import_before_the_loop", "in_thread", "start_daemon"]

T = TypeVar("T")


def start_daemon(func: Callable[..., Any], *args: Any, name: str) -> None:
    """``func(*args)`` in a new daemon thread that nobody joins; inline where no thread can be started (Python 3.12+
    during interpreter shutdown: "can't create new thread at interpreter shutdown"), as a stop must still run."""
    try:
        threading.Thread(target=func, args=args, name=name, daemon=True).start()
    except RuntimeError:
        func(*args)


def _threaded(func: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """``func(*args)`` in a new daemon thread (inline where none can be started); the future of its result."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():
            return  # cancelled before it began
        try:
            done.set_result(func(*args))
        except BaseException as exc:  # noqa: BLE001 - raised by whoever awaits `done`
            done.set_exception(exc)

    start_daemon(run, name=f"asyncllm-{getattr(func, '__name__', 'step')}")
    return done


async def in_thread(func: Callable[..., T], *args: Any, abandoned: Callable[[T], None] | None = None) -> T:
    """``func(*args)`` in a thread of its own. Cancelled (a plain asyncio cancel too: ``asyncio.wait_for``,
    ``asyncio.run`` shutting down, which anyio's shield does not hold off), it returns at once and the thread runs
    on: `abandoned` then gets what `func` returns (a core to stop), in a thread (`_hand_over`)."""
    done = _threaded(func, *args)
    try:
        return await asyncio.wrap_future(done)
    except asyncio.CancelledError:
        if abandoned is not None:
            done.add_done_callback(lambda f: _hand_over(f, abandoned))
        raise


def _hand_over(done: concurrent.futures.Future[T], abandoned: Callable[[T], None]) -> None:
    """Called in the thread that finished `done`, or on the loop when it finished before the cancel: `abandoned`
    (stopping a core waits) always runs in a thread of its own."""
    if not done.cancelled() and done.exception() is None:
        start_daemon(abandoned, done.result(), name="asyncllm-abandoned")


async def finish_in_thread(func: Callable[..., Any], *args: Any) -> None:
    """``func(*args)`` in a thread of its own, awaited to its end even when the caller is cancelled, as often as it
    is (cleanup that must finish: stopping processes; anyio's shield does not hold off a plain asyncio cancel); the
    cancel is raised afterwards."""
    loop = asyncio.get_running_loop()  # first: a coroutine closed outside its loop (by the collector) starts nothing
    future = asyncio.wrap_future(_threaded(func, *args), loop=loop)
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
    future.result()
    if cancelled:
        raise asyncio.CancelledError


def import_before_the_loop() -> None:
    """An engine made where no event loop runs (a module's, before the app serves) imports transformers, and so
    torch, at once: on the start's preparation thread their imports hold the GIL for up to half a second at a
    time, stalling the loop. Made inside a running loop, it leaves them to that thread (no blocking call there)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        from asyncllm.engine.prepare import import_transformers

        import_transformers()
