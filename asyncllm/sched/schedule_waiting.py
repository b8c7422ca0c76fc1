"""The scheduler's waiting requests: admitting them into a step, and making room for a higher-priority one.

`schedule_waiting` is step 2 of `Scheduler.schedule()` (asyncllm/sched/scheduler.py): waiting requests in
queue order take what the running ones left, starting from their resume point (prefix-cache hits, a swapped
request's swap-in) and computing the prompt or a chunk of it, until blocks, budget or seats run out. A request
whose LoRA adapter would be one too many (max_loras) is skipped and keeps its place; once it has been skipped more
than `MAX_LORA_SKIPS` steps, the adapter requests queued after it are held too, so that the running adapters drain
and free a slot for it (vLLM has no such bound: its skipped request can wait for as long as the running adapters'
traffic lasts). `preempt_for_priority` is step 0 under 'priority': when the first waiting request would not be
admitted in this step, the shortest tail of running requests of lower priority after which it would be (a seat, an
adapter slot, token budget left by the running requests that stay, free blocks: `_running_plan` predicts what
`Scheduler._schedule_running` will take) is preempted, and nobody when no tail would do: a victim that does not let
it run only loses its KV and recomputes (vLLM never preempts for a waiting request).
"""

from __future__ import annotations

from collections.abc import Iterable
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
    """Preempt the fewest lower-priority running requests, from the tail, after which the first waiting one is
    admitted in this step (`_num_victims`); none when it would not be even with all of them gone: they would lose
    their KV for nothing."""
    head = sched.waiting.peek()
    num_victims = _num_victims(sched, head, step)
    if num_victims:
        why = f"request {head.request_id} of higher priority was waiting"
        for _ in range(num_victims):
            preempt_in_step(sched, sched.running.pop(), step, why=why)


def _num_victims(sched: Scheduler, head: Request, step: _Step) -> int:
    """How many running requests of lower priority than `head`, from the tail, must go for `head` to be admitted in
    this step: the fewest that leave it a seat, an adapter slot (max_loras), token budget after the running requests
    that stay, and free blocks for theirs and its first chunk (a victim's block held by a request that stays, as a
    shared prefix block, frees nothing); 0 when none would do."""
    running, kv = sched.running, sched.kv_cache_manager
    num_eligible = 0
    while num_eligible < len(running) and running[-1 - num_eligible].priority > head.priority:
        num_eligible += 1
    if not num_eligible:
        return 0
    plan = _running_plan(sched, step)
    hits, num_computed, _ = _resume_point(sched, head)
    hit_ids = {block.block_id for block in hits}
    holders: dict[int, int] = {}  # block id -> how many of the victims so far hold it
    loras = _lora_counts(sched, head)
    num_freed, last_budget, num_needed = 0, -1, None
    for num_victims in range(num_eligible + 1):
        if num_victims:
            victim = running[-num_victims]
            num_freed += _num_freed(kv.req_to_blocks.get(victim.request_id, ()), holders, hit_ids)
            if loras.get(victim.lora_int_id, 0) > 0:
                loras[victim.lora_int_id] -= 1
        num_kept = len(running) - num_victims
        budget, num_blocks, num_scheduled = plan[num_kept]
        if num_kept >= sched.max_num_seqs or (step.max_reqs is not None and num_scheduled >= step.max_reqs):
            continue
        if _one_too_many(head.lora_int_id, {lora for lora, n in loras.items() if n}, sched.max_loras):
            continue
        if budget != last_budget:
            last_budget, num_needed = budget, _first_chunk_blocks(sched, head, hits, num_computed, budget)
        if num_needed is not None and num_blocks + num_needed <= kv.num_free_blocks + num_freed:
            return num_victims
    return 0


def _lora_counts(sched: Scheduler, head: Request) -> dict[int, int]:
    """The running requests of each adapter, when `head`'s could be one too many (max_loras); else empty."""
    counts: dict[int, int] = {}
    if sched.max_loras and head.lora_int_id:
        for request in sched.running:
            if request.lora_int_id:
                counts[request.lora_int_id] = counts.get(request.lora_int_id, 0) + 1
    return counts


def _first_chunk_blocks(sched: Scheduler, head: Request, hits: list[KVCacheBlock], num_computed: int,
                        budget: int) -> int | None:
    """The free blocks `head`'s first chunk would take under `budget`, as `schedule_waiting` admits it; None: it
    would get no token."""
    num_new = sched.chunking.admission_chunk(head.num_tokens - num_computed, budget)
    if head.mm_items:
        num_new = whole_spans(head.mm_items, num_computed, num_new, budget)
    if not num_new:
        return None
    return sched.kv_cache_manager.num_blocks_to_allocate(head, num_computed - len(hits) * sched.block_size + num_new,
                                                         hits)


def _one_too_many(lora_id: int, loras: set[int], max_loras: int) -> bool:
    """Whether adapter `lora_id` (0: none) would make `max_loras` + 1 distinct adapters beside `loras`."""
    return bool(lora_id) and lora_id not in loras and len(loras) >= max_loras


def _num_freed(blocks: Iterable[KVCacheBlock], holders: dict[int, int], hit_ids: set[int]) -> int:
    """Blocks one more victim frees: those every holder of which is now a victim (a shared prefix block frees
    nothing while a request that stays holds it), less the waiting request's prefix hits (it takes them back)."""
    num_freed = 0
    for block in blocks:
        held = holders[block.block_id] = holders.get(block.block_id, 0) + 1
        if held == block.ref_cnt and block.block_id not in hit_ids:
            num_freed += 1
    return num_freed


def _running_plan(sched: Scheduler, step: _Step) -> list[tuple[int, int, int]]:
    """The token budget left, the blocks taken and the requests scheduled once the first 0, 1, ... of the running
    requests are scheduled in this step, as `Scheduler._schedule_running` would (drafts at their most)."""
    kv = sched.kv_cache_manager
    spec = sched.config.scheduler_config.speculative
    max_drafts = spec.num_speculative_tokens if sched.proposer is not None and spec is not None else 0
    budget, num_blocks, num_scheduled = step.budget, 0, 0
    plan = [(budget, num_blocks, num_scheduled)]
    for request in sched.running:
        if budget > 0 and (step.max_running is None or num_scheduled < step.max_running):
            num_new = _running_chunk(sched, request, budget, max_drafts)
            if num_new:
                num_blocks += kv.num_blocks_to_allocate(request, num_new)
                budget -= num_new
                num_scheduled += 1
        plan.append((budget, num_blocks, num_scheduled))
    return plan


def _running_chunk(sched: Scheduler, request: Request, budget: int, max_drafts: int) -> int:
    """The tokens `schedule_each` (asyncllm/sched/schedule_each.py) would schedule for a running request, its
    drafts counted at their most; 0: none this step."""
    num_computed = request.num_computed_tokens
    num_new = request.num_tokens - num_computed
    if num_new == 1:
        return 1 + min(max_drafts, budget - 1) if request.draft_buffer is not None else 1
    if not num_new:
        return 0
    num_new = sched.chunking.chunk(num_new, budget)
    return whole_spans(request.mm_items, num_computed, num_new, budget) if request.mm_items else num_new


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
