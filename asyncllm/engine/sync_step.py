"""The engine core's synchronous step (``async_scheduling=False``, and speculative decoding): schedule one step,
run it on the workers, apply its output and send it.

A step that admits waiting requests or preempts running ones first sends the hosts a fresh stats snapshot
(`moved_requests`), as the overlapped step does when it submits one (asyncllm/engine/overlap.py): the snapshot
sent after step N was taken before step N+1's admission, and during a long step N+1 the hosts would see its
requests as still waiting. `wait_for_blocks` is both paths' step that scheduled nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from asyncllm import errors, protocol
from asyncllm.sched.step_outputs import StepOutputs

if TYPE_CHECKING:
    from asyncllm.engine.core import EngineCore

__all__ = ["moved_requests", "sync_step", "wait_for_blocks"]

_Outputs = StepOutputs | list[tuple[bytes, protocol.RequestOutputDelta]]


def sync_step(core: "EngineCore", outputs: _Outputs, changed: bool) -> None:
    """Schedule and run one step; `outputs` (timeouts) go out with its results, or before it with a fresh
    snapshot when it admits or preempts requests."""
    sched_out = core.scheduler.schedule()
    if not (sched_out.total_num_scheduled_tokens or sched_out.finished_req_ids or sched_out.preempted_req_ids):
        wait_for_blocks(core, outputs, changed)
        return
    if core.structured.matchers:
        sched_out.grammar_bitmask = core.structured.grammar_bitmask(sched_out, core.scheduler.requests)
    if moved_requests(sched_out):
        core.send_outputs(outputs)
        outputs = []
    try:
        runner_out = core.executor.execute_model(sched_out)
    except errors.EngineDeadError as exc:  # nothing of the step was applied: recompute its requests
        core.recover_workers(exc)
        core.send_outputs(outputs)
        return
    core.forget_failed(runner_out.failed_requests)
    failed = core.scheduler.fail_requests(runner_out.failed_requests)  # before the step: drop their tokens
    step_outputs = core.scheduler.update_from_output(sched_out, runner_out)
    if core.structured.matchers:
        core.structured.accept(step_outputs.deltas, core.scheduler.finish_requests)
    core.send_outputs(outputs + failed + step_outputs)


def wait_for_blocks(core: "EngineCore", outputs: _Outputs, changed: bool) -> None:
    """Nothing was scheduled (and no step is in flight): send what changed, then wait a moment."""
    if outputs or changed:  # the queue changed: hosts' admission estimates need fresh stats
        core.send_outputs(outputs)
    time.sleep(0.001)  # nothing fits right now; wait for an abort, a timeout or a finish to free blocks


def moved_requests(sched_out: protocol.SchedulerOutput | None) -> bool:
    """Whether a step admitted waiting requests or preempted running ones. The hosts' stats must not show the
    admitted requests as waiting while it runs, a long step and the aborts sent meanwhile included: its outputs
    come when it ends (a whole step later with `async_scheduling`, where the first step after an idle pipeline
    collects nothing when it is submitted)."""
    return sched_out is not None and bool(sched_out.new_reqs or sched_out.preempted_req_ids)
