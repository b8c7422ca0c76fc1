"""The engine core's overlapped step (``async_scheduling=True``): schedule step N+1 while the workers run step N.

One call of `OverlappedSteps.step`, in the steady state: schedule step N+1
(its decodes read the placeholders of step N, asyncllm/sched/placeholders.py),
submit it to the workers, send the outputs of step N-1 (collected by the call
before), then collect step N and apply it; its outputs are held until the next
call has submitted step N+2. The workers go from step N to step N+1 without
waiting for the core, and the core's scheduling, output handling and host
messages run while they compute. What lies between a step's output reaching
the core and the next step's submission is only the apply and the schedule:
the host messages (the stats snapshot, encoding, the I/O thread's hand-off)
come after the submission, and a host hears of a step's tokens one schedule
later. At most one step runs ahead; with pipeline micro-batches (P stages),
P - 1 (each of disjoint requests: asyncllm/sched/placeholders.py).

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
        self.held: StepOutputs | None = None
        """The last collected step's outputs, sent once the next step is submitted; only while a step is in flight
        (so the core's loop calls `step` or `drain` next, and either sends them before anything else)."""

    @property
    def in_flight(self) -> bool:
        return len(self.placeholders) > 0

    def step(self, outputs: _Outputs, changed: bool) -> None:
        """Schedule and submit one step, send the held outputs, collect the previous step and hold its outputs;
        `outputs` (timeouts) go out after the held ones."""
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
            if len(self.placeholders) >= self.max_in_flight:  # a step stays in flight: the next call sends these
                self._send(outputs, changed or collected, sched_out)
                outputs, changed, collected = [], False, False
                self.held = self._collect()
                return
        except errors.EngineDeadError as exc:  # the steps in flight are lost: their requests are recomputed
            self.placeholders.discard_all()
            core.recover_workers(exc)
            collected = True  # the hosts' stats changed (requests went back to waiting)
        self._send(outputs, changed or collected, sched_out)

    def drain(self, outputs: _Outputs) -> None:
        """Collect every step in flight and send its outputs (nothing is left to schedule)."""
        self._send_held()
        try:
            while self.in_flight:
                outputs = outputs + self._collect()
        except errors.EngineDeadError as exc:
            self.placeholders.discard_all()
            self.core.recover_workers(exc)
        self.core.send_outputs(outputs)

    def _idle_step(self, outputs: _Outputs, changed: bool) -> None:
        """Nothing was scheduled: collect the step in flight, or wait for blocks to free up."""
        fresh = self._send_held()
        if self.in_flight:  # its output may finish requests: schedule again at once
            self.core.send_outputs(outputs + self._collect())
            return
        wait_for_blocks(self.core, outputs, changed and not fresh)

    def _send(self, outputs: _Outputs, changed: bool, sched_out: protocol.SchedulerOutput | None) -> None:
        """Send the held outputs, then `outputs`, or the stats alone when something changed or the step admitted or
        preempted requests (and the held outputs' message did not carry them already)."""
        fresh = self._send_held()
        if outputs or (not fresh and (changed or moved_requests(sched_out))):  # admitted or preempted: fresh stats
            self.core.send_outputs(outputs)

    def _send_held(self) -> bool:
        """Send the held outputs in a message of their own (a message is one step's: the hosts apply its full deltas
        before its one-token lists, and count its tokens as one iteration); whether there were any."""
        if self.held is None:
            return False
        held, self.held = self.held, None
        self.core.send_outputs(held)
        return True

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

