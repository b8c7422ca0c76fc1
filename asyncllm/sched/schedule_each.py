"""The scheduler's running requests one at a time: what `schedule_decodes` (asyncllm/sched/decode_step.py) does
not take (prefills under way, speculative drafts, pipeline micro-batches, the requests after a decode that found no
free block).

`Scheduler._schedule_running` calls `schedule_each` for the running requests from the first the bulk decodes did
not schedule; same result as the vectorized path for the steps both can do (tests/unit/test_decode_step.py).
When a request finds no free block, running requests from it on are preempted until it does (`victim_index`;
maybe itself: then the loop ends).
"""

from __future__ import annotations

from functools import partial
from itertools import islice
from typing import TYPE_CHECKING

from asyncllm.sched.preemption import preempt_until_allocated
from asyncllm.spec.draft_model import DraftModelProposer

if TYPE_CHECKING:
    from asyncllm.sched.request import Request
    from asyncllm.sched.scheduler import Scheduler, _Step

__all__ = ["draft_room", "schedule_each"]


def schedule_each(sched: Scheduler, step: _Step, start: int) -> None:
    """Schedule the running requests from index `start` on, each its decode, drafts or prefill chunk, while the
    budget (and a micro-batch's `max_running`) lasts."""
    # Names bound once, and a decode with room in its last block needs no allocate_slots call.
    running = sched.running
    draft = partial(_drafts, sched, step) if sched.proposer is not None else None
    max_running = step.max_running
    kv = sched.kv_cache_manager
    allocate_slots, cache_full_blocks, block_size = kv.allocate_slots, kv.cache_full_blocks, sched.block_size
    last_slot = block_size - 1
    cached = step.cached_reqs  # flat lists, one entry per request: no object per request
    append_cached_id, append_cached_computed = cached.req_ids.append, cached.num_computed_tokens.append
    cached_new_block_ids = cached.new_block_ids
    num_scheduled_tokens = step.num_scheduled_tokens
    budget = step.budget
    # Preemption only removes this request or one after it (never one before), so iterating while the list
    # shrinks is safe: when the request preempts itself the loop ends.
    for request in islice(running, start, None):
        if budget <= 0 or (max_running is not None and len(num_scheduled_tokens) >= max_running):
            break
        req_id = request.request_id
        num_computed = request.num_computed_tokens
        num_new = request.num_tokens - num_computed
        if not num_new:  # a micro-batch in flight samples its next token, or one that ends a full-length request
            assert max_running is not None or request.num_tokens >= sched.max_seq_len, request
            continue
        drafts = draft(request, budget) if draft is not None and num_new == 1 else None
        slot = num_computed % block_size
        if num_new == 1 and slot and not drafts:  # the block of the last computed token has room for this one
            if slot == last_slot:  # and this token fills it: register it now
                cache_full_blocks(request, num_computed + 1)
        else:
            if drafts:
                num_new += len(drafts)
                if step.draft_blocks is not None:  # under 'priority': the blocks they take beyond the token's
                    num_blocks = kv.num_blocks_to_allocate
                    step.draft_blocks -= num_blocks(request, num_new) - num_blocks(request, 1)
            elif num_new != 1:
                num_new = sched.chunking.prefill_chunk(request, budget)
                if not num_new:  # an image's rows need a fuller step
                    continue
            assert num_new > 0, request
            new_block_ids = allocate_slots(request, num_new)
            if new_block_ids is None and drafts:  # no room for the drafts: one token, as without them
                drafts, num_new = None, 1
                new_block_ids = allocate_slots(request, num_new)
            if new_block_ids is None:
                new_block_ids = preempt_until_allocated(sched, request, num_new, step)
                if new_block_ids is None:
                    # It preempted itself: the last one under fcfs; under 'priority' (where step 0 leaves step 1
                    # nothing to preempt) the ones after it outrank it, and wait for the next step.
                    break
            if new_block_ids:
                cached_new_block_ids[req_id] = new_block_ids
            if (num_computed + num_new) % block_size < num_new:  # this step fills a block: register it now
                cache_full_blocks(request, min(num_computed + num_new, request.num_tokens))  # drafts wait
            if drafts:
                step.spec_token_ids[req_id] = drafts
        append_cached_id(req_id)
        append_cached_computed(num_computed)
        num_scheduled_tokens[req_id] = num_new
        budget -= num_new
    step.budget = budget


def _drafts(sched: Scheduler, step: _Step, request: Request, budget: int) -> list[int]:
    """A decoding request's drafts: as many as the budget, max_tokens and the sequence length leave room for (and
    under 'priority' the slots of its blocks and `step.draft_blocks` more: blocks no other request's token needs)."""
    buffer = request.draft_buffer
    if buffer is None:
        return []
    room = draft_room(request, budget)
    if step.draft_blocks is not None:
        held = len(sched.kv_cache_manager.req_to_blocks.get(request.request_id, ()))
        num_computed, block_size = request.num_computed_tokens, sched.block_size
        num_blocks = max(held, num_computed // block_size + 1) + step.draft_blocks  # its token's, and the spare ones
        room = min(room, num_blocks * block_size - num_computed - 1)
    if isinstance(sched.proposer, DraftModelProposer):  # proposed by the workers after the last step
        return sched.proposer.take(request.request_id, room)
    return sched.proposer.propose(request.all_token_ids, buffer, room)  # type: ignore[union-attr]


def draft_room(request: Request, budget: int) -> int:
    """The drafts a decoding request may take this step: what the budget and its max_tokens leave after its token."""
    return min(budget - 1, request.max_output_tokens - (request.num_tokens - request.num_prompt_tokens) - 1)
