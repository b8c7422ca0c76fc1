"""Putting the scheduler back in step with workers that lost their state (a worker restart).

New workers start with an empty KV cache, an empty CPU swap space and no
request rows. Every request that held KV goes back to the front of the
waiting queue, in running order, to be recomputed from its prompt and the
tokens it already generated, exactly as a recompute preemption would do: the
host has seen those tokens and no others, so its streams continue with no
token lost or repeated, and greedy outputs are unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm.protocol import EngineCoreEventType
from asyncllm.sched.request import RequestStatus

if TYPE_CHECKING:
    from asyncllm.sched.scheduler import Scheduler

__all__ = ["requeue_all_for_recompute", "recompute_with_new_weights"]


def requeue_all_for_recompute(scheduler: "Scheduler") -> int:
    """Drop every request's KV (GPU and swapped) and the prefix cache; queue the running ones again.

    Call between steps or after a step that failed (its results never
    arrived, so nothing of it was applied). Returns how many were running.
    """
    running, scheduler.running = scheduler.running, []
    kv = scheduler.kv_cache_manager
    for request in reversed(running):  # add_preempted puts each in front: the first running ends up first
        kv.free(request)
        scheduler.rows.detach(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        scheduler.waiting.add_preempted(request)
    scheduler.preemptor.num_preemptions_total += len(running)  # engine-wide as per request (vLLM's counter)
    for request in scheduler.requests.values():  # waiting requests hold none; this is cheap insurance
        kv.free(request)
    if scheduler.swap_space is not None:
        for req_id in list(scheduler.swap_space.swapped):  # their CPU copies died with the workers
            scheduler.swap_space.free(req_id)
    assert kv.num_used_blocks == 0, f"{kv.num_used_blocks} blocks are still held"
    kv.reset_prefix_cache()
    return len(running)


def recompute_with_new_weights(scheduler: "Scheduler") -> int:
    """After a weight update (docs/weight-updates.md): as `requeue_all_for_recompute`, but the workers live on, so
    the next step also tells them to drop the running requests' rows. Returns how many were running."""
    running_ids = [request.request_id for request in scheduler.running]
    num_running = requeue_all_for_recompute(scheduler)
    scheduler.forget_on_workers(running_ids)
    return num_running
