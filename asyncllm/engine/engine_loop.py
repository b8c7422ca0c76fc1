"""`EngineLoop`: which event loop an `AsyncEngine` (asyncllm/engine/async_engine.py) serves, a mixin: a request
from another open loop is refused, and the next loop takes a closed loop's engine over (docs/reliability.md,
Lifecycle)."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import TYPE_CHECKING

from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.launched import keep_orphan
from asyncllm.engine.prepare import Prepared
from asyncllm.engine.replica import ReplicaSet
from asyncllm.errors import EventLoopError, running_asyncio_loop
from asyncllm.procutil import check_not_forked

__all__ = ["EngineLoop"]


class EngineLoop:
    """Mixin of `AsyncEngine`: its loop, its start lock per loop, and a closed loop's takeover."""

    _loop: asyncio.AbstractEventLoop | None
    _owner_pid: int | None
    _start_lock: asyncio.Lock | None
    _start_lock_loop: asyncio.AbstractEventLoop | None
    _starting: asyncio.Task[Prepared] | None
    _in_flight: weakref.WeakSet[RequestCollector]
    _replicas: ReplicaSet
    _started: bool
    _closed: bool

    if TYPE_CHECKING:
        def _abort(self, request_id: str, collector: RequestCollector | None = None) -> None: ...

    def _loop_start_lock(self) -> asyncio.Lock:
        """The calling loop's start lock: an asyncio.Lock belongs to the loop that first waited on it, so a loop that
        takes the engine over (or retries a failed start) gets its own; starts of one loop wait for each other."""
        loop = asyncio.get_running_loop()
        if self._start_lock is None or self._start_lock_loop is not loop:
            self._start_lock, self._start_lock_loop = asyncio.Lock(), loop
        return self._start_lock

    def _check_loop(self) -> None:
        """Requests and lifecycle calls come from the loop the engine started in: outputs are delivered there, so a
        request from another loop would wait forever. Once that loop is closed (``asyncio.run`` returned, a
        per-test loop ended) the engine moves to the calling loop (`_rebind`)."""
        check_not_forked(self._owner_pid, "AsyncEngine")
        loop = running_asyncio_loop()  # trio (anyio's trio backend): an EventLoopError saying asyncllm needs asyncio
        bound = self._loop
        if bound is None or bound is loop:
            return
        if not bound.is_closed():
            raise EventLoopError(
                "this AsyncEngine started in another event loop, which is still open, and delivers its outputs "
                "there: use it from that loop only (one engine per event loop), use SyncEngine "
                "(asyncllm.integrations.sync) from other threads, or start and aclose() it within each loop")
        self._rebind(loop)

    def _rebind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve `loop` from now on; the closed loop's requests are aborted (their tasks were cancelled with it) and
        their collectors ended (a stream of that loop raises `EventLoopError` here: `RequestStream._check_loop`). A
        start or core restart that loop left pending is dropped, what it launched stopped (asyncllm/engine/
        launched.py); a core that died while no loop ran (its death was delivered to none), or whose restart that
        loop's end cut off, is restarted now by its supervisor."""
        for collector in list(self._in_flight):
            if not collector.finished:
                self._abort(collector.request_id, collector)
                with contextlib.suppress(RuntimeError):  # a waiter of a loop closed with its tasks still pending
                    collector.put_error(EventLoopError("its event loop closed; the engine moved to another loop"))
        self._in_flight = weakref.WeakSet()
        self._loop = loop
        if self._starting is not None:  # the closed loop's start (a finished one clears it): it never goes on
            keep_orphan(self._starting)
            self._starting = None
        for replica in self._replicas:
            replica.drop_orphaned(self._started)
            if self._started and not self._closed:
                replica.check_dead()
                if replica.alive:  # a cut-off restart whose core serves (start_replica done): nothing to retry
                    replica.supervisor.served()
