"""The scheduler's waiting requests: admitting them into a step, and making room for a higher-priority one.

`schedule_waiting` is step 2 of `Scheduler.schedule()` (asyncllm/sched/scheduler.py): waiting requests in
queue order take what the running ones left, starting from their resume point (prefix-cache hits, a swapped
request's swap-in) and computing the prompt or a chunk of it, until blocks, budget or seats run out. A request
whose LoRA adapter would be one too many (max_loras) is skipped and keeps its place; once it has been skipped more
than `MAX_LORA_SKIPS` steps, the adapter requests queued after it are held too, so that the running adapters drain
and free a slot for it (vLLM has no such bound: its skipped request can wait for as long as the running adapters'
traffic lasts). `preempt_for_priority` is step 0 under 'priority': when the first waiting request would not be
admitted in this step, the fewest running requests of lower priority, in vLLM's victim order (greatest
`priority_key` first), after which it would be (a seat, an adapter slot, token budget left by the running requests
that stay, free blocks: `_running_plan` predicts what `Scheduler._schedule_running` will take, with the same chunk
arithmetic: `ChunkPolicy.prefill_chunk`, `draft_room`, `ChunkPolicy.first_chunk`) are preempted, and nobody when no
number would do: a victim that does not let it run only loses its KV and recomputes (vLLM never preempts for a
waiting request).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from asyncllm import protocol
from asyncllm.protocol import EngineCoreEventType
from asyncllm.sched.decode_step import may_run_short
from asyncllm.sched.preemption import preempt_in_step, victim_order
from asyncllm.sched.request import RequestStatus
from asyncllm.sched.schedule_each import draft_room

if TYPE_CHECKING:
    from asyncllm.kv.block_pool import KVCacheBlock
    from asyncllm.sched.request import Request
    from asyncllm.sched.scheduler import Scheduler, _Step

__all__ = ["MAX_LORA_SKIPS", "preempt_for_priority", "schedule_waiting"]

MAX_LORA_SKIPS = 16
"""Steps a waiting request may be skipped for lack of an adapter slot before later adapter requests are held."""


def preempt_for_priority(sched: Scheduler, step: _Step) -> bool:
    """Step 0 under 'priority': vLLM's victims when the running requests' next tokens need more blocks than are free
    (`_short_victims`), else the fewest lower-priority running requests after which the first waiting one is admitted
    in this step (`_victims`). Whether it preempted for blocks: then, as when step 1 preempts, nobody is admitted."""
    victims = _short_victims(sched, step)
    for victim in victims:
        sched.running.remove(victim)
        preempt_in_step(sched, victim, step)
    if victims or not sched.waiting:
        return bool(victims)
    head = sched.waiting.peek()
    why = f"request {head.request_id} of higher priority was waiting"
    for victim in _victims(sched, head, step):
        sched.running.remove(victim)
        preempt_in_step(sched, victim, step, why=why)
    return False


def _short_victims(sched: Scheduler, step: _Step) -> list[Request]:
    """The fewest running requests, in `victim_order` (greatest `priority_key` first), after which the others'
    next tokens (drafts aside: they are dropped when no block is left for them) fit the free blocks: vLLM's victims,
    which it takes as it meets a request without room (one it already served included); asyncllm takes them before
    serving any.
    With drafts, the blocks the others' next tokens leave free are `step.draft_blocks`: step 1 gives drafts only
    those, so it never preempts (vLLM's drafts may take a block a later request then preempts for)."""
    kv = sched.kv_cache_manager
    if not may_run_short(sched, _max_drafts(sched)):  # cheap (arrays over the rows), most steps: every draft fits
        return []
    eligible = victim_order(sched.running)
    freed, plan = _Freed(sched, eligible, set()), _running_plan(sched, step, drafts=False)
    spare: dict[int, int] = {}  # victims -> the free blocks left after the others' next tokens

    def fits(num_victims: int) -> bool:
        _, num_blocks, _ = plan(set(map(id, eligible[:num_victims])))
        spare[num_victims] = kv.num_free_blocks + freed[num_victims] - num_blocks
        return spare[num_victims] >= 0

    num_victims = _fewest(fits, 0, len(eligible))
    if sched.proposer is not None:
        step.draft_blocks = spare[num_victims]
    return eligible[:num_victims]


def _victims(sched: Scheduler, head: Request, step: _Step) -> list[Request]:
    """The running requests of lower priority than `head`, in `victim_order` (greatest `priority_key` first),
    the fewest of which must go for `head` to be admitted in this step: a seat, an adapter slot (max_loras), token
    budget after the running requests that stay, and free blocks for theirs and its first chunk (a victim's block
    held by a request that stays, as a shared prefix block, frees nothing); none when none would do."""
    running, kv = sched.running, sched.kv_cache_manager
    eligible = victim_order(r for r in running if r.priority > head.priority)
    if not eligible:
        return []
    low = max(len(running) - sched.max_num_seqs + 1, _adapter_bound(sched, head, eligible))  # a seat, a slot
    if low > len(eligible):
        return []
    hits, num_computed, _ = _resume_point(sched, head)
    freed, plan = _Freed(sched, eligible, {block.block_id for block in hits}), _running_plan(sched, step)

    def admitted(num_victims: int) -> bool:
        budget, num_blocks, num_scheduled = plan(set(map(id, eligible[:num_victims])))
        if step.max_reqs is not None and num_scheduled >= step.max_reqs:
            return False
        num_needed = _first_chunk_blocks(sched, head, hits, num_computed, budget)
        return num_needed is not None and num_blocks + num_needed <= kv.num_free_blocks + freed[num_victims]

    return eligible[:_fewest(admitted, max(low, 0), len(eligible))]


def _fewest(enough: Callable[[int], bool], low: int, high: int) -> int:
    """The fewest victims from `low` to `high` that are `enough`, by bisection, each try a pass over the running
    requests (`_running_plan`); 0 when `high` is not enough. More victims leave as much room or more (but where a
    prefill that stays takes the budget a victim left, and blocks with it), and the count returned was tried."""
    if enough(low):
        return low
    if low == high or not enough(high):
        return 0
    low += 1
    while low < high:
        mid = (low + high) // 2
        if enough(mid):
            high = mid
        else:
            low = mid + 1
    return high


class _Freed:
    """The blocks the first 0, 1, ... `victims` free (`_num_freed`), counted as far as asked."""

    def __init__(self, sched: Scheduler, victims: list[Request], hit_ids: set[int]) -> None:
        self._req_to_blocks, self._victims, self._hit_ids = sched.kv_cache_manager.req_to_blocks, victims, hit_ids
        self._holders: dict[int, int] = {}  # block id -> how many of the victims so far hold it
        self._freed = [0]

    def __getitem__(self, num_victims: int) -> int:
        freed = self._freed
        while len(freed) <= num_victims:
            victim = self._victims[len(freed) - 1]
            blocks = self._req_to_blocks.get(victim.request_id, ())
            freed.append(freed[-1] + _num_freed(blocks, self._holders, self._hit_ids))
        return freed[num_victims]


def _adapter_bound(sched: Scheduler, head: Request, victims: list[Request]) -> int:
    """The fewest `victims` after which `head`'s adapter is not one too many (max_loras); len(victims) + 1: none."""
    if not (sched.max_loras and head.lora_int_id):
        return 0
    counts: dict[int, int] = {}
    for request in sched.running:
        if request.lora_int_id:
            counts[request.lora_int_id] = counts.get(request.lora_int_id, 0) + 1
    for num_victims in range(len(victims) + 1):
        if num_victims and counts.get(victims[num_victims - 1].lora_int_id, 0) > 0:
            counts[victims[num_victims - 1].lora_int_id] -= 1
        if not _one_too_many(head.lora_int_id, {lora for lora, n in counts.items() if n} | set(sched.pinned_loras),
                             sched.max_loras):
            return num_victims
    return len(victims) + 1


def _first_chunk_blocks(sched: Scheduler, head: Request, hits: list[KVCacheBlock], num_computed: int,
                        budget: int) -> int | None:
    """The free blocks `head`'s first chunk would take under `budget`, as `schedule_waiting` admits it; None: it
    would get no token."""
    num_new = sched.chunking.first_chunk(head, num_computed, budget)
    if not num_new:
        return None
    return sched.kv_cache_manager.num_blocks_to_allocate(head, _num_slots(sched, hits, num_computed, num_new), hits)


def _num_slots(sched: Scheduler, hits: list[KVCacheBlock], num_computed: int, num_new: int) -> int:
    """The slots an admitted request allocates beyond its prefix hits: its resume point's rest and first chunk."""
    return num_computed - len(hits) * sched.block_size + num_new


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


def _max_drafts(sched: Scheduler) -> int:
    """The most drafts a running request may get in a step: none without a proposer."""
    spec = sched.config.scheduler_config.speculative
    return spec.num_speculative_tokens if sched.proposer is not None and spec is not None else 0


def _running_plan(sched: Scheduler, step: _Step, drafts: bool = True) -> Callable[[set[int]], tuple[int, int, int]]:
    """The token budget left, the blocks taken and the requests scheduled once the running requests but those
    `gone` (their ids) are scheduled in this step, as `Scheduler._schedule_running` would (drafts at their most,
    or none), for any `gone`: a decode's token and blocks, the same under any budget, are counted once."""
    kv, chunking, running = sched.kv_cache_manager, sched.chunking, sched.running
    max_drafts = _max_drafts(sched) if drafts else 0
    decodes = [kv.num_blocks_to_allocate(r, 1) if r.num_tokens - r.num_computed_tokens == 1
               and not (max_drafts and r.draft_buffer is not None) else None for r in running]
    max_running = step.max_running

    def plan(gone: set[int]) -> tuple[int, int, int]:
        budget, num_blocks, num_scheduled = step.budget, 0, 0
        for request, decode_blocks in zip(running, decodes):
            if budget <= 0 or (max_running is not None and num_scheduled >= max_running):
                break
            if gone and id(request) in gone:
                continue
            if decode_blocks is not None:
                num_new = 1
                num_blocks += decode_blocks
            else:
                num_new = request.num_tokens - request.num_computed_tokens
                if num_new == 1:  # drafts
                    num_new += min(max_drafts, draft_room(request, budget))
                elif num_new:
                    num_new = chunking.prefill_chunk(request, budget)
                if not num_new:
                    continue
                num_blocks += kv.num_blocks_to_allocate(request, num_new)
            budget -= num_new
            num_scheduled += 1
        return budget, num_blocks, num_scheduled

    return plan


def schedule_waiting(sched: Scheduler, step: _Step) -> None:
    """Admit waiting requests in queue order while budget, seats, free blocks (and a micro-batch's `max_reqs`)
    last: their prefix-cache hits, a swapped request's swap-in, then the prompt or a chunk of it."""
    kv = sched.kv_cache_manager
    loras = {r.lora_int_id for r in sched.running if r.lora_int_id} if sched.max_loras and sched.waiting else set()
    loras.update(sched.pinned_loras)  # a pinned adapter holds its slot (pin_lora)
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
        num_new = sched.chunking.first_chunk(request, num_computed, step.budget)
        if num_new == 0:
            break
        block_ids = kv.allocate_slots(request, _num_slots(sched, hits, num_computed, num_new), hits)
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
    swap = sched.swap_space
    entry = swap.swapped.get(request.request_id) if swap is not None and swap.swapped else None
    # a swapped request's own copy beats the CPU tier; none for a request that skips prefix-cache reads
    hits, num_computed = sched.kv_cache_manager.get_computed_blocks(request, offloaded=entry is None)
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
    sched.running.append(request)
