"""The host's engine-core supervisor (`max_core_restarts`): a dead core is replaced, the engine lives on.

When the engine core dies (killed, crashed, or its workers failed past
`max_worker_restarts`), the processor thread fails every open stream with
`EngineDeadError` within a second: their state died with the core. Without a
supervisor the engine stays dead (fail-stop, vLLM's behaviour). With one,
the loop starts a restart at once: the old processor thread and core are
stopped, a new core is launched (or, for `AsyncEngine.connect`, the shared
core is attached to again), and requests submitted meanwhile wait for it.
Restarts are bounded like worker restarts: `max_core_restarts` within
`RESTART_WINDOW_S`; past that, or if a restart fails, the engine stays dead.

The restart task is owned by the engine: `aclose` cancels it and waits while it stops what it launched (a
restart left half done would otherwise leave a core process behind; waited for to its end, it held the close, and
the other replicas' streams, for as long as a model load). A restart
cut off by its event loop's end (``asyncio.run`` returning cancels it; a loop
closed with it pending never runs it again) is retried by the next loop's
takeover, without taking another restart from the budget; so is the restart
of a core that died while no loop ran (`AsyncEngine._rebind`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from asyncllm.engine.launched import keep_orphan
from asyncllm.workers.restart import RESTART_WINDOW_S, RestartBudget

__all__ = ["CoreSupervisor"]

logger = logging.getLogger("asyncllm.engine")


class CoreSupervisor:
    """Runs `restart` (on the loop) after the core died, while the restart budget lasts."""

    def __init__(self, max_restarts: int, restart: Callable[[], Awaitable[None]], name: str = "engine core") -> None:
        self.budget = RestartBudget(max_restarts)
        self.name = name
        """What the log lines call the core ("engine core 1" for a data-parallel replica's)."""
        self._restart = restart
        self._task: asyncio.Task[None] | None = None
        self._cut_off = False
        """The latest restart never finished (its loop ended): the next one is its retry, on the budget it took."""
        self._handled: BaseException | None = None
        """The death last acted on (restarted, or left dead past the budget): told again (every delivery of another
        replica, every request's pick), it changes nothing and logs nothing."""

    @property
    def enabled(self) -> bool:
        return self.budget.max_restarts > 0

    @property
    def restarting(self) -> bool:
        return self._task is not None and not self._task.done()

    def on_core_dead(self, error: BaseException) -> None:
        """The processor reported the core dead (on the loop): start a restart if the budget allows."""
        if not self.enabled or self.restarting or (error is self._handled and not self._cut_off):
            return  # a failed restart too: the engine stays dead (docs/reliability.md)
        self._handled = error
        if self._cut_off:
            logger.warning("%s: its restart was cut off by the end of its event loop; restarting it again", self.name)
        elif self.budget.try_take():
            logger.error("%s died (%s); restarting it (restart %d)", self.name, error, self.budget.num_restarts_total)
        else:
            logger.error("%s died (%s); max_core_restarts=%d within %.0f s is spent: it stays dead",
                         self.name, error, self.budget.max_restarts, RESTART_WINDOW_S)
            return
        self._cut_off = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="asyncllm-core-restart")

    def drop_orphaned(self) -> None:
        """A takeover: a restart whose loop closed with it pending never goes on (asyncllm/engine/launched.py); the
        next death report retries it."""
        task = self._task
        if task is not None and not task.done() and task.get_loop().is_closed():
            keep_orphan(task)
            self._task, self._cut_off = None, True

    def served(self) -> None:
        """A takeover found the core alive: a restart cut off after its core started needs no retry, and the next
        death takes from the budget as ever."""
        self._cut_off = False

    async def wait(self) -> None:
        """Until the restart in progress (if any) is done; never raises (the engine's state tells)."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait([task])

    async def cancel(self) -> None:
        """The engine closes: the restart in progress (if any) is cancelled, which stops what it launched as a
        cancelled start does (`replica.start_replica`), and waited for; never raises."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])

    async def _run(self) -> None:
        try:
            await self._restart()
        except asyncio.CancelledError:  # its loop ended (asyncio.run returning): the next loop's takeover retries it
            self._cut_off = True
            raise
        except Exception as exc:  # noqa: BLE001 - the engine stays dead and says why
            logger.error("restarting the %s failed: %s", self.name, exc)
        else:
            logger.warning("%s restarted", self.name)
