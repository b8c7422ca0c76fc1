"""The engine core's overlapped step (``async_scheduling=True``): schedule step N+1 while the workers run step N.

One call of `OverlappedSteps.step`, in the steady state: schedule step N+1
(its decodes read the placeholders of step N, asyncllm/sched/placeholders.py),
submit it to the workers, then collect step N, apply it and send its outputs.
The workers go from step N to step N+1 without waiting for the core, and the
core's scheduling, output handling and host messages run while they compute.
At most one step runs ahead; with pipeline micro-batches (P stages), P - 1
(each of disjoint requests: asyncllm/sched/placeholders.py).

A step is scheduled synchronously, after collecting the one in flight, when it
needs every token known: while structured-output requests run (the grammar
bitmask of step N+1 needs step N's token) and when `schedule()` could preempt
(`OutputPlaceholders.may_preempt`). A worker failure drops the steps in
flight; the restarted workers recompute them (workers/restart.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm import errors, protocol
from asyncllm.engine.sync_step import moved_requests, wait_for_blocks
from asyncllm.sched.placeholders import OutputPlaceholders
from asyncllm.sched.step_outputs import StepOutputs

if TYPE_CHECKING:
    from asyncllm.engine.core import EngineCore

__all__ = ["OverlappedSteps"]

_Outputs = StepOutputs | list[tuple[bytes, protocol.RequestOutputDelta]]


class OverlappedSteps:
    """The core's steps with at most one step in flight ahead of its output (P - 1 with pipeline micro-batches)."""

    def __init__(self, core: "EngineCore") -> None:
        self.core = core
        self.placeholders = OutputPlaceholders(core.scheduler)
        self.max_in_flight = max(2, core.scheduler.concurrent_batches)
        """Steps submitted and not collected at most: one running ahead, or one per pipeline stage."""
        self.num_sync_steps = 0
        """Steps scheduled after collecting the one in flight (structured output, possible preemption)."""

    @property
    def in_flight(self) -> bool:
        return len(self.placeholders) > 0

    def step(self, outputs: _Outputs, changed: bool) -> None:
        """Schedule and submit one step, collect the previous one; `outputs` (timeouts) go out with its results."""
        core = self.core
        collected = False
        sched_out = None
        try:
            if self.in_flight and (core.structured.matchers or self.placeholders.may_preempt()):
                while self.in_flight:
                    outputs = outputs + self._collect()
                collected = True
                self.num_sync_steps += 1
            sched_out = core.scheduler.schedule()
            if not (sched_out.total_num_scheduled_tokens or sched_out.finished_req_ids or sched_out.preempted_req_ids):
                self._idle_step(outputs, changed or collected)
                return
            if core.structured.matchers:
                sched_out.grammar_bitmask = core.structured.grammar_bitmask(sched_out, core.scheduler.requests)
            self.placeholders.advance(sched_out)
            core.executor.submit(sched_out)
            if len(self.placeholders) >= self.max_in_flight:
                outputs = outputs + self._collect()
                collected = True
        except errors.EngineDeadError as exc:  # the steps in flight are lost: their requests are recomputed
            self.placeholders.discard_all()
            core.recover_workers(exc)
            collected = True  # the hosts' stats changed (requests went back to waiting)
        if outputs or changed or collected or moved_requests(sched_out):  # admitted or preempted: fresh stats now
            core.send_outputs(outputs)

    def drain(self, outputs: _Outputs) -> None:
        """Collect every step in flight and send its outputs (nothing is left to schedule)."""
        try:
            while self.in_flight:
                outputs = outputs + self._collect()
        except errors.EngineDeadError as exc:
            self.placeholders.discard_all()
            self.core.recover_workers(exc)
        self.core.send_outputs(outputs)

    def _idle_step(self, outputs: _Outputs, changed: bool) -> None:
        """Nothing was scheduled: collect the step in flight, or wait for blocks to free up."""
        if self.in_flight:  # its output may finish requests: schedule again at once
            self.core.send_outputs(outputs + self._collect())
            return
        wait_for_blocks(self.core, outputs, changed)

    def _collect(self) -> StepOutputs:
        """Wait for the oldest step in flight and apply it."""
        core = self.core
        runner_out = core.executor.collect()
        own = self.placeholders.own(runner_out.failed_requests)
        core.forget_failed(own)
        failed = self.placeholders.fail(own)  # before the step: drop their tokens
        step_outputs = self.placeholders.commit(runner_out)
        if core.structured.matchers:
            core.structured.accept(step_outputs.deltas, core.scheduler.finish_requests)
        step_outputs.deltas[:0] = failed
        return step_outputs

