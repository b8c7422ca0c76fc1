"""`Scheduler.update_from_output` one request at a time: the steps `update_decodes` (asyncllm/sched/decode_step.py)
does not take (speculative decoding, several tokens for a request, requests gone since `schedule()`).

Same result as the vectorized path for the steps both can do (tests/unit/test_decode_step.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm import protocol
from asyncllm.sched.request import RequestStatus
from asyncllm.sched.step_outputs import StepOutputs

if TYPE_CHECKING:
    from asyncllm.sched.scheduler import Scheduler

__all__ = ["update_each"]


def update_each(sched: Scheduler, sched_out: protocol.SchedulerOutput, runner_out: protocol.ModelRunnerOutput
                ) -> StepOutputs:
    """`Scheduler.update_from_output`, one request at a time: any step (`update_decodes` does the usual ones)."""
    num_scheduled_tokens = sched_out.num_scheduled_tokens
    spec_token_ids = sched_out.spec_token_ids
    step_outputs = StepOutputs()
    outputs = step_outputs.deltas
    # Names bound once, the requests looked up in one pass before the loop, `Request.append_sampled_tokens`
    # inlined for one token, and no delta but two list appends unless the request finished, has events or got
    # its first token (speculative steps of a large batch still come through here).
    requests, max_seq_len, block_size = sched.requests, sched.max_seq_len, sched.block_size
    cache_full_blocks = sched.kv_cache_manager.cache_full_blocks
    append_output = outputs.append
    RUNNING = RequestStatus.RUNNING
    last_client = append_req_id = append_token = None  # the token lists of the last plain output's host
    any_finished = False
    num_extra_tokens = num_prompt_computed = 0  # tokens generated: one per output, plus these
    for request, num_scheduled, token_ids in zip(list(map(requests.get, num_scheduled_tokens)),
                                                 num_scheduled_tokens.values(),
                                                 _sampled_in_order(num_scheduled_tokens, runner_out)):
        if request is None or request.status is not RUNNING:
            continue
        req_id = request.request_id
        drafts = spec_token_ids.get(req_id) if spec_token_ids else None
        if drafts is not None:  # the KV holds the last token and the accepted drafts; the rest is rejected
            num_scheduled = sched.spec_stats.observe(len(drafts), token_ids)
        before = request.num_computed_tokens
        after = request.num_computed_tokens = before + num_scheduled
        num_prompt = request.num_prompt_tokens
        if before < num_prompt:
            num_prompt_computed += (after if after < num_prompt else num_prompt) - before
        if after % block_size < num_scheduled and len(request.block_hashes) < after // block_size and not drafts:
            cache_full_blocks(request)  # a block filled whose last token was unknown when scheduled (async)
        num_tokens = request.num_tokens
        if after < num_tokens:
            continue  # a prefill chunk: nothing sampled
        assert token_ids, f"the worker sampled no token for {req_id} at the end of its tokens"
        if len(token_ids) == 1:
            token = token_ids[0]
            request.all_token_ids.append(token)
            request.num_tokens = num_tokens + 1
            if token in request.stop_check_token_ids or num_tokens + 1 - num_prompt >= request.max_output_tokens:
                request.check_stop(max_seq_len)  # max_output_tokens is capped by max_seq_len (add_request)
            elif request.events is None and num_tokens != num_prompt and request.plain_outputs:
                client_id = request.client_id  # not finished, nothing to report but the token: the host's lists
                if client_id is not last_client:
                    last_client = client_id
                    req_ids, tokens = step_outputs.token_lists(client_id)
                    append_req_id, append_token = req_ids.append, tokens.append
                append_req_id(req_id)
                append_token(token)
                continue
        else:
            token_ids = request.append_sampled_tokens(token_ids, max_seq_len)
            num_extra_tokens += len(token_ids) - 1
            if drafts:  # blocks the accepted drafts filled (known tokens now), before a finished request frees them
                cache_full_blocks(request)
        finish_reason = request.finish_reason
        delta = protocol.RequestOutputDelta(req_id, token_ids, finish_reason, request.stop_reason,
                                            request.num_cached_tokens if num_tokens == num_prompt else 0)
        delta.events, request.events = request.events, None
        sched.rows.events_sent(request)  # (running: it holds a row until freed below)
        append_output((request.client_id, delta))
        if finish_reason is not None:
            sched.free_finished(request)
            any_finished = True
    sched.prompt_tokens_total += num_prompt_computed
    sched.generation_tokens_total += len(step_outputs) + num_extra_tokens  # before logprobs add prompt-only deltas
    if any_finished:
        sched.running = [r for r in sched.running if not r.status.is_finished]
    return step_outputs


def _sampled_in_order(num_scheduled_tokens: dict[str, int], runner_out: protocol.ModelRunnerOutput) -> list[list[int]]:
    """The worker's sampled tokens for each scheduled request, in `num_scheduled_tokens` order (None: none returned).

    Workers answer in that order already (one list per scheduled request), so
    the usual cost is one comparison of the id lists, not a dict.
    """
    req_ids = runner_out.req_ids
    if len(req_ids) == len(num_scheduled_tokens) and req_ids == list(num_scheduled_tokens):
        return runner_out.sampled_token_ids
    by_id = dict(zip(req_ids, runner_out.sampled_token_ids))
    return [by_id.get(req_id) for req_id in num_scheduled_tokens]  # type: ignore[misc]
