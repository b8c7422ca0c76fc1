"""The scheduler's waiting requests: admitting them into a step, and making room for a higher-priority one.

`schedule_waiting` is step 2 of `Scheduler.schedule()` (asyncllm/sched/scheduler.py): waiting requests in
queue order take what the running ones left, starting from their resume point (prefix-cache hits, a swapped
request's swap-in) and computing the prompt or a chunk of it, until blocks, budget or seats run out. A request
whose LoRA adapter would be one too many (max_loras) is skipped and keeps its place; once it has been skipped more
than `MAX_LORA_SKIPS` steps, the adapter requests queued after it are held too, so that the running adapters drain
and free a slot for it (vLLM has no such bound: its skipped request can wait for as long as the running adapters'
traffic lasts). `preempt_for_priority` is step 0 under 'priority': running requests of lower priority are
preempted while the first waiting request finds no seat or too few free blocks, unless its adapter would stay one
too many (it would be skipped anyway: the preempted requests only recomputed, step after step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm import protocol
from asyncllm.protocol import EngineCoreEventType
from asyncllm.sched.chunking import whole_spans
from asyncllm.sched.preemption import insert_running, preempt_in_step
from asyncllm.sched.request import RequestStatus

if TYPE_CHECKING:
    from asyncllm.kv.block_pool import KVCacheBlock
    from asyncllm.sched.request import Request
    from asyncllm.sched.scheduler import Scheduler, _Step

__all__ = ["MAX_LORA_SKIPS", "preempt_for_priority", "schedule_waiting"]

MAX_LORA_SKIPS = 16
"""Steps a waiting request may be skipped for lack of an adapter slot before later adapter requests are held."""


def preempt_for_priority(sched: Scheduler, step: _Step) -> None:
    """Preempt lower-priority running requests while the first waiting one lacks a seat or blocks (never for one
    whose adapter would still be one too many: it is skipped all the same, and they would only recompute)."""
    head = sched.waiting.peek()
    if _adapter_blocked(sched, head):
        return
    while sched.running and sched.running[-1].priority > head.priority and _lacks_room(sched, head):
        why = f"request {head.request_id} of higher priority was waiting"
        preempt_in_step(sched, sched.running.pop(), step, why=why)


def _adapter_blocked(sched: Scheduler, head: Request) -> bool:
    """Whether `head`'s adapter would be one too many (max_loras) with every lower-priority request preempted."""
    if not (sched.max_loras and head.lora_int_id):
        return False
    kept = {r.lora_int_id for r in sched.running if r.lora_int_id and r.priority <= head.priority}
    return _one_too_many(head.lora_int_id, kept, sched.max_loras)


def _one_too_many(lora_id: int, loras: set[int], max_loras: int) -> bool:
    """Whether adapter `lora_id` (0: none) would make `max_loras` + 1 distinct adapters beside `loras`."""
    return bool(lora_id) and lora_id not in loras and len(loras) >= max_loras


def _lacks_room(sched: Scheduler, head: Request) -> bool:
    """Whether `head` finds no seat, or fewer free blocks than its first chunk and the decodes need."""
    if len(sched.running) >= sched.max_num_seqs:
        return True
    kv = sched.kv_cache_manager
    hits, num_computed, _ = _resume_point(sched, head)
    num_new = sched.chunking.admission_chunk(head.num_tokens - num_computed, sched.max_num_batched_tokens)
    needed = kv.num_blocks_to_allocate(head, num_computed - len(hits) * sched.block_size + num_new, hits)
    decodes = sum(kv.num_blocks_to_allocate(r, 1) for r in sched.running)
    return needed + decodes > kv.num_free_blocks


def schedule_waiting(sched: Scheduler, step: _Step) -> None:
    """Admit waiting requests in queue order while budget, seats, free blocks (and a micro-batch's `max_reqs`)
    last: their prefix-cache hits, a swapped request's swap-in, then the prompt or a chunk of it."""
    kv = sched.kv_cache_manager
    loras = {r.lora_int_id for r in sched.running if r.lora_int_id} if sched.max_loras and sched.waiting else set()
    skipped: list[Request] = []  # their adapter would be one too many (max_loras), or is held: they keep their place
    draining = False  # a request skipped over MAX_LORA_SKIPS steps waits: adapter requests after it are held
    while sched.waiting and step.budget > 0 and len(sched.running) < sched.max_num_seqs:
        if step.max_reqs is not None and len(step.num_scheduled_tokens) >= step.max_reqs:
            break
        request = sched.waiting.peek()
        if step.preempted_req_ids and request.request_id in step.preempted_req_ids:
            break  # preempted for a higher-priority request in this very step
        lora_id = request.lora_int_id
        if _one_too_many(lora_id, loras, sched.max_loras):
            request.num_lora_skips += 1
            draining = draining or request.num_lora_skips > MAX_LORA_SKIPS
            skipped.append(sched.waiting.pop())
            continue
        if draining and lora_id:  # the running adapters drain until a slot frees for the starved request
            skipped.append(sched.waiting.pop())
            continue
        hits, num_computed, swapped = _resume_point(sched, request)
        num_new = sched.chunking.admission_chunk(request.num_tokens - num_computed, step.budget)
        if request.mm_items:
            num_new = whole_spans(request.mm_items, num_computed, num_new, step.budget)
        if num_new == 0:
            break
        block_ids = kv.allocate_slots(request, num_computed - len(hits) * sched.block_size + num_new, hits)
        if block_ids is None:
            break
        sched.waiting.pop()
        if swapped:
            assert sched.swap_space is not None
            step.blocks_to_swap_in += sched.swap_space.resume(request.request_id, len(hits), block_ids[len(hits):])
        _admit(sched, request, num_computed)
        if lora_id:
            loras.add(lora_id)
        kv.cache_full_blocks(request, num_computed + num_new)  # siblings admitted after it may hit these
        step.new_reqs.append(
            protocol.NewRequestData(
                req_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                params=request.params,
                block_ids=block_ids,
                num_computed_tokens=num_computed,
                eos_token_ids=request.eos_token_ids,
                mm_items=request.mm_items,
                lora=request.lora,
                pooling=request.pooling,
                prompt_embeds=request.prompt_embeds,
            )
        )
        step.num_scheduled_tokens[request.request_id] = num_new
        step.budget -= num_new
    for request in reversed(skipped):
        sched.waiting.add_preempted(request)


def _resume_point(sched: Scheduler, request: Request) -> tuple[list[KVCacheBlock], int, bool]:
    """A waiting request's prefix hits, the tokens it starts with computed, and whether it is swapped out.

    A swapped-out request starts with all its swapped tokens computed
    (hits for the leading blocks still cached, the rest swapped in), or
    with its hits alone when they cover more.
    """
    pools_all = request.pooling is not None and request.pooling.pooling_type != "LAST"
    swap = sched.swap_space
    entry = swap.swapped.get(request.request_id) if swap is not None and swap.swapped else None
    if request.params.prompt_logprobs is None and not pools_all:  # a swapped request's own copy beats the CPU tier
        hits, num_computed = sched.kv_cache_manager.get_computed_blocks(request, offloaded=entry is None)
    else:  # prompt_logprobs, MEAN/CLS pooling need every prompt position's row: no prefix-cache reads (as vLLM)
        hits, num_computed = [], 0
    if entry is None:
        return hits, num_computed, False
    return hits, max(num_computed, entry.num_computed_tokens), True


def _admit(sched: Scheduler, request: Request, num_computed_tokens: int) -> None:
    sched.rows.attach(request)
    request.status = RequestStatus.RUNNING
    request.record_event(EngineCoreEventType.SCHEDULED)
    request.num_computed_tokens = num_computed_tokens
    request.num_lora_skips = 0
    if request.num_preemptions == 0:
        request.num_cached_tokens = num_computed_tokens
    insert_running(sched.running, request, sched.policy)
