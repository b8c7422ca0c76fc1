"""Preemption: taking a running request's KV blocks away, and the running order victims come from.

The scheduler keeps `running` in admission order under both policies (as
vLLM V1): the running requests are served in that order when the token
budget is short. The victim (`victim_index`) is the most recently admitted
request under 'fcfs', the greatest ``(priority, arrival_time)`` (the lowest
priority, latest arrival) under 'priority'.

`Preemptor.preempt` frees the victim's GPU blocks, by recompute (its KV is
dropped) or by swap (its computed blocks are copied to the CPU `SwapSpace`
first; recompute when that is full), puts it back at the front of the
waiting queue, counts it and warns (rate-limited). While the scheduler builds
a step, `preempt_in_step` also drops the victim's row and lists it in the
step's `preempted_req_ids`; `preempt_until_allocated` takes victims among the
running requests not yet served in the step until a request's new slots fit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from asyncllm.kv.manager import KVCacheManager
from asyncllm.kv.swap import SwapSpace
from asyncllm.protocol import EngineCoreEventType
from asyncllm.sched.queue import RequestQueue
from asyncllm.sched.request import Request, RequestStatus

if TYPE_CHECKING:
    from asyncllm.sched.scheduler import Scheduler, _Step

__all__ = [
    "PreemptionLogger", "Preemptor", "preempt_in_step", "preempt_until_allocated", "priority_key", "victim_index",
    "victim_order",
]

logger = logging.getLogger("asyncllm.sched")


def priority_key(request: Request) -> tuple[int, float]:
    """A request's rank under 'priority': the greatest is preempted first."""
    return request.priority, request.arrival_time


def victim_index(running: list[Request], start: int, policy: str) -> int:
    """The index in `running` of the request to preempt among those from `start` on: the last under 'fcfs', the
    last of the greatest `priority_key` under 'priority' (vLLM V1's max over its running requests, but for ties:
    the latest admitted, as under 'fcfs', so that equals such as one request's samples cannot livelock)."""
    if policy != "priority":
        return len(running) - 1
    return max(range(start, len(running)), key=lambda i: (priority_key(running[i]), i))


def victim_order(requests: Iterable[Request]) -> list[Request]:
    """`requests` (in admission order) in the order `victim_index` takes them under 'priority': greatest
    `priority_key` first, the latest admitted first among equals."""
    ranked = list(enumerate(requests))
    ranked.sort(key=lambda pair: (priority_key(pair[1]), pair[0]), reverse=True)
    return [request for _, request in ranked]


class PreemptionLogger:
    """Warns about preemptions at most once per `interval_s`, counting the ones it kept quiet."""

    def __init__(self, interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last_logged: float | None = None
        self._num_suppressed = 0

    def record(self, request_id: str, mode: str, num_preemptions_total: int, why: str = "the KV cache ran out of free blocks") -> None:
        """One preemption; `mode` is how it was done ('recompute', 'swap', or a fallback note)."""
        now = self._clock()
        if self._last_logged is not None and now - self._last_logged < self.interval_s:
            self._num_suppressed += 1
            return
        suppressed = f" ({self._num_suppressed} more not logged)" if self._num_suppressed else ""
        self._last_logged, self._num_suppressed = now, 0
        logger.warning(
            "Request %s was preempted (mode=%s) because %s; "
            "%d preemptions so far%s. Preemption hurts latency and throughput: raise "
            "gpu_memory_utilization or tensor_parallel_size, or lower max_num_seqs or "
            "max_num_batched_tokens.",
            request_id, mode, why, num_preemptions_total, suppressed,
        )


class Preemptor:
    """Preempts running requests by `preemption_mode`; counts them (`num_preemptions_total`, `num_swapped_total`)."""

    def __init__(self, mode: str, kv_cache_manager: KVCacheManager, swap_space: SwapSpace | None,
                 waiting: RequestQueue, log_interval_s: float) -> None:
        self.mode = mode
        self.kv_cache_manager = kv_cache_manager
        self.swap_space = swap_space
        self.waiting = waiting
        self.logger = PreemptionLogger(log_interval_s)
        self.num_preemptions_total = 0
        self.num_swapped_total = 0
        """Preemptions done by swapping to the CPU (the others recomputed)."""

    def preempt(self, request: Request, blocks_to_swap_out: list[list[int]], why: str) -> None:
        """Free the request's GPU blocks (after queueing its swap-out copies, room permitting); queue it again."""
        mode = self.mode
        swap = self.swap_space
        if swap is not None:
            if swap.can_swap_out(request.num_computed_tokens):
                block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
                blocks_to_swap_out += swap.swap_out(request.request_id, block_ids, request.num_computed_tokens)
                self.num_swapped_total += 1
            else:
                mode = "recompute: the swap space is full"
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0  # a swapped request's computed count is kept by the swap space
        request.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.waiting.add_preempted(request)
        self.num_preemptions_total += 1
        self.logger.record(request.request_id, mode, self.num_preemptions_total, why)


def preempt_in_step(sched: Scheduler, request: Request, step: _Step,
                    why: str = "the KV cache ran out of free blocks") -> None:
    """Preempt `request`, already taken out of `sched.running`, in the step being scheduled."""
    assert not step.blocks_to_swap_in, "a swap-out after a swap-in could reuse a CPU block being read"
    sched.rows.detach(request)
    sched.preemptor.preempt(request, step.blocks_to_swap_out, why)
    step.preempted_req_ids.append(request.request_id)


def preempt_until_allocated(sched: Scheduler, request: Request, num_new: int, step: _Step) -> list[int] | None:
    """Preempt victims (`victim_index`; maybe `request` itself) until its slots fit; None if it was the victim.

    Victims come from `request` on: the requests before it were served in
    this step (vLLM may take one of those back). Under 'priority' asyncllm's
    step 0 takes vLLM's victims before any is served and leaves drafts only
    the blocks no next token needs, so this is a safeguard there. Removing
    one after `request` leaves the caller's iteration over `running` intact.
    """
    running = sched.running
    start = next(i for i, r in enumerate(running) if r is request) if sched.policy == "priority" else 0
    while True:
        victim = running.pop(victim_index(running, start, sched.policy))
        preempt_in_step(sched, victim, step)
        if victim is request:
            return None
        new_block_ids = sched.kv_cache_manager.allocate_slots(request, num_new)
        if new_block_ids is not None:
            return new_block_ids
