"""The scheduler's decode step over all running requests at once (numpy over `RequestRows`).

In a busy engine most steps only decode: every running request computes its
one new token. `schedule_decodes` schedules the running requests' one-token
decodes (all of them, or those before the first prefill under way) and
`update_decodes` applies any step whose requests sampled at most one token
each, with whole-batch array operations; Python work per request is left only
for what cannot be vectorized: the requests that enter a new KV block or fill
one (allocation, prefix-cache hashing, about one in `block_size`), appending
each sampled token to its request's token list, and a full delta for the
requests that stop or report more than a token. Each declines (0 / None,
nothing changed) or stops part-way when the step is not of that kind; the
per-request loops (asyncllm/sched/schedule_each.py, asyncllm/sched/update_each.py)
do the rest, with the same result.
"""

from __future__ import annotations

from collections import deque
from itertools import chain, islice
from typing import TYPE_CHECKING

import numpy as np

from asyncllm import protocol
from asyncllm.sched.rows import StepRows
from asyncllm.sched.step_outputs import StepOutputs

if TYPE_CHECKING:
    from asyncllm.sched.request import Request
    from asyncllm.sched.scheduler import Scheduler, _Step

__all__ = ["may_run_short", "running_rows", "schedule_decodes", "step_record", "update_decodes"]


def running_rows(sched: Scheduler) -> StepRows:
    """The running list's requests with their rows, kept while the list holds the same requests.

    The same requests mean the same order: the list only changes by
    admissions and removals, and every admission takes a new serial.
    """
    cached, running, rows = sched.running_order, sched.running, sched.rows
    if cached is None or len(cached) != len(running) or not cached.live(rows).all():
        cached = sched.running_order = rows.rows_of(list(running))
    return cached


def may_run_short(sched: Scheduler, extra: int = 0) -> bool:
    """Whether the running requests' largest possible next chunks (each the whole step budget, and `extra` tokens
    more each: drafts at their most) need more blocks than are free: the next `schedule()` may preempt for blocks;
    False is certain."""
    running = sched.running
    if not running:
        return False
    kv = sched.kv_cache_manager
    block_size, tables = sched.block_size, kv.req_to_blocks
    order, rows = running_rows(sched), sched.rows
    computed = rows.computed[order.rows]
    needed = np.minimum(computed + sched.max_num_batched_tokens, rows.tokens[order.rows]) + extra
    needed_blocks = -(-needed // block_size)
    # A request's blocks cover its computed tokens: only those whose next chunk reaches past them may need more.
    maybe = (needed_blocks > -(-computed // block_size)).nonzero()[0]
    free = kv.num_free_blocks
    for i, num_blocks in zip(maybe.tolist(), needed_blocks[maybe].tolist()):
        missing = num_blocks - len(tables[order.req_ids[i]])
        if missing > 0:
            free -= missing
            if free < 0:
                return True
    return False


def schedule_decodes(sched: Scheduler, step: _Step) -> int:
    """Schedule one token for each running request from the first on while they decode; how many were scheduled.

    Covers the running requests up to the first that does not decode exactly
    one token (a prefill under way), or as many as the budget allows (0: none,
    nothing done). Stops early at the first request that finds no free block.
    The per-request loop goes on from the first request not covered.
    """
    running = sched.running
    if not running or step.budget <= 0:
        return 0
    order = running_rows(sched)
    rows = sched.rows
    computed = rows.computed[order.rows]
    decodes = rows.tokens[order.rows] - computed == 1
    num_decodes = len(running) if decodes.all() else int(decodes.argmin())  # the first prefill's position
    num_decodes = min(num_decodes, step.budget)
    if not num_decodes:
        return 0
    computed = computed[:num_decodes]
    step.bulk = order
    block_size = sched.block_size
    slots = computed % block_size
    kv = sched.kv_cache_manager
    requests, num_computed = order.requests, computed.tolist()
    num = num_decodes
    starting = (slots == 0).nonzero()[0].tolist()  # their token starts a block: allocate it, in running order
    if starting:
        got = kv.append_decode_blocks([requests[i] for i in starting], [num_computed[i] for i in starting],
                                      step.cached_reqs.new_block_ids)
        if got < len(starting):  # the free queue ran dry here: the per-request loop preempts from this request on
            num = starting[got]
    filling = (slots[:num] == block_size - 1).nonzero()[0].tolist()  # their token fills a block: cache it now
    if filling:
        kv.cache_decode_blocks([requests[i] for i in filling], [num_computed[i] + 1 for i in filling])
    req_ids = order.req_ids[:num]
    step.cached_reqs.req_ids = req_ids
    step.cached_reqs.num_computed_tokens = num_computed[:num]
    step.num_scheduled_tokens = order.one_token_each() if num == len(order) else dict.fromkeys(req_ids, 1)
    step.budget -= num
    step.num_bulk = num
    return num


def step_record(sched: Scheduler, out: protocol.SchedulerOutput, bulk: StepRows | None, num_bulk: int) -> StepRows:
    """The scheduled requests in `num_scheduled_tokens` order with their rows and token counts.

    The first `num_bulk` are the first of `bulk` (the running list as `schedule_decodes` saw it), one token each.
    """
    num_scheduled = out.num_scheduled_tokens
    if bulk is not None and num_bulk == len(num_scheduled) == len(bulk):  # the whole running list decodes
        record = StepRows(bulk.requests, bulk.req_ids, bulk.rows, bulk.serials)
        record._token_lists = bulk.token_lists
        record.num_scheduled = np.ones(num_bulk, dtype=np.int64)
        return record
    requests = sched.requests
    rest = sched.rows.rows_of([requests[req_id] for req_id in islice(num_scheduled, num_bulk, None)])
    rest_counts = np.fromiter(islice(num_scheduled.values(), num_bulk, None), dtype=np.int64, count=len(rest))
    if bulk is None or not num_bulk:
        rest.num_scheduled = rest_counts
        return rest
    record = StepRows(bulk.requests[:num_bulk] + rest.requests, bulk.req_ids[:num_bulk] + rest.req_ids,
                      np.concatenate([bulk.rows[:num_bulk], rest.rows]),
                      np.concatenate([bulk.serials[:num_bulk], rest.serials]))
    record.num_scheduled = np.concatenate([np.ones(num_bulk, dtype=np.int64), rest_counts])
    return record


def update_decodes(sched: Scheduler, sched_out: protocol.SchedulerOutput, runner_out: protocol.ModelRunnerOutput,
                   record: StepRows) -> StepOutputs | None:
    """Apply a step in which every request is still running and sampled at most one token; None if it is not one.

    Prefill chunks are fine (their counts advance, nothing is sampled);
    speculative steps, several tokens per request and requests gone since
    `schedule()` are for the per-request loop.
    """
    rows = sched.rows
    if sched_out.spec_token_ids or runner_out.req_ids != record.req_ids or not record.live(rows).all():
        return None
    before = rows.computed[record.rows]
    after = before + record.num_scheduled
    samples = after >= rows.tokens[record.rows]  # the step reached the end of its known tokens: the worker sampled it
    new_tokens = _one_token_each(runner_out.sampled_token_ids, samples)
    if new_tokens is None:  # several tokens for some (or a worker's bug): one request at a time
        return None
    _count_computed(sched, record, before, after)
    index = samples.nonzero()[0]
    if not len(index):  # prefill chunks only
        return StepOutputs()
    return _apply_tokens(sched, record, index, new_tokens)


def _count_computed(sched: Scheduler, record: StepRows, before: np.ndarray, after: np.ndarray) -> None:
    """The step's tokens are computed: the rows' counts, the prompt-token counter, the blocks they completed."""
    rows, num_scheduled = sched.rows, record.num_scheduled
    rows.computed[record.rows] = after
    prompt_left = rows.num_prompt[record.rows] - before
    if (prompt_left > 0).any():  # prefill chunks
        sched.prompt_tokens_total += int(np.minimum(num_scheduled, prompt_left).clip(0).sum())
    if record.placeholders is not None:  # scheduled with a step in flight: some blocks ended in a placeholder
        _register_filled_blocks(sched, record.requests, after, num_scheduled)


def _apply_tokens(sched: Scheduler, record: StepRows, index: np.ndarray, new_tokens: list[int]) -> StepOutputs:
    """Append the sampled tokens (of the requests at `index` in the step) and build the hosts' outputs."""
    rows = sched.rows
    requests, req_ids, token_lists, row_ids = record.requests, record.req_ids, record.token_lists, record.rows
    if len(index) < len(record):  # some only computed a prefill chunk
        requests, req_ids, token_lists = _select(index, len(record), requests, req_ids, token_lists)
        row_ids = row_ids[index]
    tokens = rows.tokens[row_ids]
    next_tokens = tokens + 1
    rows.tokens[row_ids] = next_tokens
    deque(map(list.append, token_lists, new_tokens), maxlen=0)  # each request's token onto its list
    special = next_tokens >= rows.delta_from[row_ids]  # a first token, events, logprobs, or maybe its last token
    if not rows.stop_tokens.isdisjoint(new_tokens):
        special[_stopping(requests, new_tokens, rows.stop_tokens)] = True
    outputs = StepOutputs()
    any_special = special.any()
    if not any_special and rows.num_clients == 1:  # one token each, one host: the lists are the step's
        ids, token_ids = outputs.token_lists(requests[0].client_id)
        ids.extend(req_ids)
        token_ids.extend(new_tokens)
    else:
        _token_lists(outputs, requests, req_ids, new_tokens, rows.client[row_ids], special)
    if any_special:
        _full_deltas(sched, outputs, requests, new_tokens, tokens.tolist(), special.nonzero()[0].tolist())
    sched.generation_tokens_total += len(new_tokens)
    return outputs


def _select(index: np.ndarray, num: int, *columns: list) -> list[list]:
    """The items at `index` (sorted positions out of `num`) of each list: copies with the few others deleted, or
    gathered when few are kept."""
    if len(index) * 2 < num:
        positions = index.tolist()
        return [[column[i] for i in positions] for column in columns]
    dropped = np.setdiff1d(np.arange(num), index, assume_unique=True).tolist()[::-1]
    selected = []
    for column in columns:
        column = list(column)
        for i in dropped:
            del column[i]
        selected.append(column)
    return selected


def _one_token_each(sampled: list[list[int]], samples: np.ndarray) -> list[int] | None:
    """The one token of each sampling request (workers send [] for the others); None unless each sampling request
    has exactly one and the others none (the per-request loop then refuses a sampling request left without one)."""
    if samples.all():
        try:
            return [token for token, in sampled]
        except ValueError:
            return None
    if list(map(len, sampled)) != samples.tolist():  # the same count on other requests would shift every token
        return None
    return list(chain.from_iterable(sampled))


def _register_filled_blocks(sched: Scheduler, requests: list[Request], after: np.ndarray,
                            num_scheduled: np.ndarray) -> None:
    """Prefix-cache the blocks the step filled whose last token was unknown when it was scheduled (async)."""
    block_size = sched.block_size
    filled = (after % block_size < num_scheduled).nonzero()[0]
    if not len(filled):
        return
    cache_full_blocks = sched.kv_cache_manager.cache_full_blocks
    for i, num_computed in zip(filled.tolist(), after[filled].tolist()):
        request = requests[i]
        if len(request.block_hashes) < num_computed // block_size:
            cache_full_blocks(request)


def _stopping(requests: list[Request], new_tokens: list[int], stop_tokens: frozenset[int]) -> list[int]:
    """The positions of the requests whose new token is one of their stop tokens (EOS, stop_token_ids)."""
    return [i for i, token in enumerate(new_tokens) if token in stop_tokens and token in requests[i].stop_check_token_ids]


def _token_lists(outputs: StepOutputs, requests: list[Request], req_ids: list[str], new_tokens: list[int],
                 clients: np.ndarray, special: np.ndarray) -> None:
    """The one-token outputs (not `special`) into their hosts' lists, in step order."""
    plain = (~special).nonzero()[0]
    if not len(plain):
        return
    if len(plain) < len(requests):
        positions = plain.tolist()
        req_ids = [req_ids[i] for i in positions]
        new_tokens = [new_tokens[i] for i in positions]
        requests = [requests[i] for i in positions]
        clients = clients[plain]
    if (clients == clients[0]).all():  # one host (the usual case)
        ids, tokens = outputs.token_lists(requests[0].client_id)
        ids.extend(req_ids)
        tokens.extend(new_tokens)
        return
    _, firsts = np.unique(clients, return_index=True)
    for first in sorted(firsts.tolist()):
        mine = (clients == clients[first]).nonzero()[0].tolist()
        ids, tokens = outputs.token_lists(requests[first].client_id)
        ids.extend(req_ids[i] for i in mine)
        tokens.extend(new_tokens[i] for i in mine)


def _full_deltas(sched: Scheduler, outputs: StepOutputs, requests: list[Request], new_tokens: list[int],
                 num_tokens_before: list[int], positions: list[int]) -> None:
    """A delta for each of these requests (stop check first); the finished ones are freed, in step order."""
    max_seq_len = sched.max_seq_len
    any_finished = False
    for i in positions:
        request, token, num_tokens = requests[i], new_tokens[i], num_tokens_before[i]
        num_prompt = request.num_prompt_tokens
        if token in request.stop_check_token_ids or num_tokens + 1 - num_prompt >= request.max_output_tokens:
            request.check_stop(max_seq_len)
        finish_reason = request.finish_reason
        delta = protocol.RequestOutputDelta(request.request_id, [token], finish_reason, request.stop_reason,
                                            request.num_cached_tokens if num_tokens == num_prompt else 0)
        delta.events, request.events = request.events, None
        sched.rows.events_sent(request)
        outputs.deltas.append((request.client_id, delta))
        if finish_reason is not None:
            sched.free_finished(request)
            any_finished = True
    if any_finished:
        sched.running = [r for r in sched.running if not r.status.is_finished]
