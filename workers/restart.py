"""Restarting failed workers inside the engine core, and the budget that bounds restarts.

A worker that dies (SIGKILL, a CUDA error, the OOM killer), reports an error,
or hangs past `worker_step_timeout_s` fails the executor with
`EngineDeadError`. The core then hands the failed executor to
`WorkerRestarter.recover`: it shuts the old one down (every rank, the
single-use shared-memory ring, the sockets), starts a fresh executor with the
same KV-cache size, and puts the scheduler back in step (every running
request is recomputed, see `asyncllm.sched.recovery`). A fresh executor that
fails while it starts is one more failure, and the restarter starts another;
one that starts with fewer KV blocks than before ends the engine at once (a
retry would load the model again to the same result).
More than `max_worker_restarts` failures within `RESTART_WINDOW_S` end the engine:
the error propagates and every host's streams get `EngineDeadError`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncllm.config import EngineConfig
from asyncllm.errors import EngineDeadError
from asyncllm.sched.recovery import requeue_all_for_recompute
from asyncllm.workers.executor import Executor

if TYPE_CHECKING:
    from asyncllm.sched.scheduler import Scheduler

__all__ = ["RESTART_WINDOW_S", "RestartBudget", "WorkerRestarter"]

logger = logging.getLogger("asyncllm.engine.core")

RESTART_WINDOW_S = 600.0
"""Restarts older than this no longer count against max_worker_restarts / max_core_restarts."""


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds."""

    def __init__(self, max_restarts: int, window_s: float = RESTART_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._recent: deque[float] = deque()
        self.num_restarts_total = 0

    def try_take(self) -> bool:
        """Count one restart if the budget allows it; False when it is spent."""
        now = self._clock()
        while self._recent and now - self._recent[0] >= self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            return False
        self._recent.append(now)
        self.num_restarts_total += 1
        return True


class _FewerBlocks(EngineDeadError):
    """Restarted workers that started but hold fewer KV blocks than the scheduler plans with: not retried."""


class WorkerRestarter:
    """Replaces a failed executor with a fresh one of the same KV-cache size, within the restart budget."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int,
                 executor_factory: Callable[[EngineConfig], Executor] = Executor) -> None:
        self.config = config
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.budget = RestartBudget(config.max_worker_restarts)
        self._executor_factory = executor_factory

    def recover(self, failed: Executor, scheduler: "Scheduler", error: EngineDeadError) -> Executor:
        """A new executor serving the same requests (they are recomputed); `EngineDeadError` if none can be had."""
        failed.shutdown()
        self._take_restart(error)
        started = time.monotonic()
        num_requeued = requeue_all_for_recompute(scheduler)
        logger.error("workers failed (%s); restarting them (restart %d of at most %d per %.0f s), "
                     "%d running requests will be recomputed", error, self.budget.num_restarts_total,
                     self.budget.max_restarts, RESTART_WINDOW_S, num_requeued)
        while True:
            try:
                executor = self._start_executor()
                break
            except _FewerBlocks:  # deterministic: another start would hold as few, after a full reload
                raise
            except EngineDeadError as exc:  # a new worker died while loading: one more failure, not the end
                self._take_restart(exc)
                logger.error("restarted workers failed while starting (%s); starting them again (restart %d of "
                             "at most %d per %.0f s)", exc, self.budget.num_restarts_total,
                             self.budget.max_restarts, RESTART_WINDOW_S)
        logger.warning("workers restarted in %.1f s", time.monotonic() - started)
        return executor

    def _take_restart(self, error: EngineDeadError) -> None:
        """Count one restart, or raise `EngineDeadError` (from `error`) when the budget is spent."""
        if not self.budget.try_take():
            raise EngineDeadError(
                f"{error}; the workers failed more than max_worker_restarts={self.budget.max_restarts} "
                f"times within {RESTART_WINDOW_S:.0f} s, so the engine stops") from error

    def _start_executor(self) -> Executor:
        executor = self._executor_factory(self.config)
        try:
            available = executor.start()
            short = available < self.num_gpu_blocks and self.config.num_gpu_blocks_override is None
            if short or executor.num_cpu_blocks < self.num_cpu_blocks:
                raise _FewerBlocks(
                    f"the restarted workers hold {available} KV blocks ({executor.num_cpu_blocks} CPU), fewer than "
                    f"the {self.num_gpu_blocks} ({self.num_cpu_blocks}) the scheduler plans with")
            executor.init_cache(self.num_gpu_blocks, self.num_cpu_blocks)
        except BaseException:
            executor.shutdown()
            raise
        return executor
