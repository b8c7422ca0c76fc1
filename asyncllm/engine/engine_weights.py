"""The host's side of live weight updates across replicas (docs/weight-updates.md): one `UpdateWeights` to every
replica's core, and the engine's last successful update, replayed on a core the supervisor restarts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import AsyncLLMError, EngineDeadError

if TYPE_CHECKING:
    from asyncllm.engine.replica import Replica, ReplicaSet

__all__ = ["EngineWeights", "every_replica"]

logger = logging.getLogger("asyncllm.engine")


class EngineWeights:
    """Runs updates on every replica and remembers the last one that succeeded."""

    def __init__(self) -> None:
        self.last: tuple[protocol.UpdateWeights | None, int] | None = None
        """The last successful update's message (None: tensors pushed from memory, which die with a core) and the
        weights version it gave."""
        self._in_flight: set[asyncio.Future[int]] = set()
        """Updates sent whose replicas have not all answered: a restarted core's replay waits for them."""

    async def update(self, replicas: "ReplicaSet", message: protocol.UpdateWeights,
                     when_answered: Callable[[], None] | None = None) -> int:
        """Every live replica's core runs `message` (after a core restart in progress); the lowest weights version
        after it. ``when_answered()`` runs once every replica has answered (or failed), even if the caller was
        cancelled before; at once if no replica is asked (the engine is dead, or the caller cancelled first)."""
        try:
            processors = await replicas.serving_processors()
        except BaseException:
            if when_answered is not None:
                when_answered()
            raise
        futures = [processor.update_weights(msgspec.structs.replace(message)) for processor in processors]
        if when_answered is not None:
            _call_when_all_done(futures, when_answered)
        settled = asyncio.ensure_future(self._settle(message, futures))  # recorded even if the caller is cancelled
        self._in_flight.add(settled)
        settled.add_done_callback(self._forget)
        return await asyncio.shield(settled)

    def _forget(self, settled: asyncio.Future[int]) -> None:
        self._in_flight.discard(settled)
        if not settled.cancelled():
            settled.exception()  # retrieved: a cancelled caller's failed update is not logged as never retrieved

    async def _settle(self, message: protocol.UpdateWeights, futures: list[concurrent.futures.Future[int]]) -> int:
        """The update's version once every replica answered, recorded as the last. A replica whose core died
        meanwhile does not fail an update the others made: its restarted core loads it (`replay`), so the
        replicas keep serving the same weights; any other error is raised (replicas refuse alike)."""
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        versions = [r for r in results if not isinstance(r, BaseException)]
        if not versions or not all(isinstance(failure, EngineDeadError) for failure in failures):
            raise failures[0]
        if failures:
            logger.warning("%d engine core(s) died during the weight update from %s; the others applied it and a "
                           "restarted core loads it before serving", len(failures), message.source())
        version = min(versions)
        self.last = (None if message.segment else message, version)
        return version

    def restart_config(self, config: EngineConfig) -> EngineConfig:
        """What a restarted core starts from: dummy weights when the last update was pushed (they come again)."""
        pushed = self.last is not None and self.last[0] is None
        return config.replace(load_format="dummy") if pushed else config

    async def replay(self, replica: "Replica") -> None:
        """The last update, again, on a restarted core, before any request reaches it (after the updates in
        flight, which its old core may have missed): a checkpoint is loaded again with its version; pushed weights
        are awaited (no step runs until pushes write them all)."""
        if self._in_flight:
            await asyncio.wait(self._in_flight)
        if self.last is None:
            return
        message, version = self.last
        processor = replica.processor
        assert processor is not None
        if message is None:
            processor.await_weights(version)
            return
        try:
            await asyncio.wrap_future(processor.update_weights(msgspec.structs.replace(message, weights_version=version)))
        except AsyncLLMError as exc:
            logger.error("the restarted engine core could not load the last weights again (%s); it serves the "
                         "weights the engine started with (stats().weights_version 0)", exc)


def _call_when_all_done(futures: list[concurrent.futures.Future[int]], callback: Callable[[], Any]) -> None:
    """``callback()`` once, in whichever thread completes the last of ``futures``."""
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: concurrent.futures.Future[int]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    if not futures:
        callback()
    for future in futures:
        future.add_done_callback(one_done)


async def every_replica(futures: list[concurrent.futures.Future[int]]) -> list[int]:
    """Every replica's answer; the first error once all have answered (none is left running behind)."""
    results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
    return results  # type: ignore[return-value]
