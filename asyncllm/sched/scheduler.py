"""`Scheduler`: continuous batching over a paged KV cache.

One `schedule()` builds one step under two budgets, `max_num_batched_tokens`
tokens and `max_num_seqs` requests:

1. RUNNING requests first, in admission order (decodes, and prefills under
   way). When the KV cache has no block for one, the most recently admitted
   running request (fcfs; the lowest priority one under 'priority') is
   preempted by recompute: its blocks are freed and it goes back to the front
   of the waiting queue. A request may preempt itself.
2. If nothing was preempted, WAITING requests in queue order with what is
   left: prefix-cache lookup, then a chunk of the prompt when the whole does
   not fit the token budget (chunked prefill), until blocks, budget or
   `max_num_seqs` run out (no preemption to admit a request).

`update_from_output()` applies what the workers computed and sampled, and
returns the deltas to send to the hosts. Both calls are O(scheduled requests):
no per-step work walks the block pool.

The worker samples a request when the step's tokens reach the end of its known
tokens (``num_computed_tokens + num_scheduled == num_tokens``), and samples
nothing for a prefill chunk. `num_computed_tokens` advances in
`update_from_output`, so the two calls alternate: schedule, run, update.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.kv.manager import KVCacheManager
from asyncllm.sched.queue import create_request_queue
from asyncllm.sched.request import Request, RequestStatus

__all__ = ["Scheduler", "PreemptionLogger"]

logger = logging.getLogger("asyncllm.sched")


class PreemptionLogger:
    """Warns about preemptions at most once per `interval_s`, counting the ones it kept quiet."""

    def __init__(self, interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last_logged: float | None = None
        self._num_suppressed = 0

    def record(self, request_id: str, mode: str, num_preemptions_total: int) -> None:
        now = self._clock()
        if self._last_logged is not None and now - self._last_logged < self.interval_s:
            self._num_suppressed += 1
            return
        suppressed = f" ({self._num_suppressed} more not logged)" if self._num_suppressed else ""
        self._last_logged, self._num_suppressed = now, 0
        logger.warning(
            "Request %s was preempted (mode=%s) because the KV cache ran out of free blocks; "
            "%d preemptions so far%s. Preemption hurts latency and throughput: raise "
            "gpu_memory_utilization or tensor_parallel_size, or lower max_num_seqs or "
            "max_num_batched_tokens.",
            request_id, mode, num_preemptions_total, suppressed,
        )


class _Step:
    """What one `schedule()` call has decided so far."""

    __slots__ = ("budget", "num_scheduled_tokens", "new_reqs", "cached_reqs", "preempted_req_ids")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[protocol.NewRequestData] = []
        self.cached_reqs: list[protocol.CachedRequestData] = []
        self.preempted_req_ids: list[str] = []


class Scheduler:
    """Decides every step which requests run and how many tokens each computes."""

    def __init__(
        self, config: EngineConfig, num_gpu_blocks: int, max_model_len: int, preemption_log_interval_s: float = 5.0
    ) -> None:
        self.config = config
        self.block_size: int = config.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs: int = config.max_num_seqs
        self.max_num_batched_tokens = _token_budget(config, max_model_len)
        self.enable_chunked_prefill: bool = config.enable_chunked_prefill
        self.long_prefill_token_threshold: int = config.long_prefill_token_threshold
        self.policy: str = config.scheduling_policy
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, self.block_size, config.enable_prefix_caching)
        self.max_seq_len = min(max_model_len, num_gpu_blocks * self.block_size)
        """Longest sequence: max_model_len, or less when the whole KV cache holds fewer tokens."""
        if self.max_seq_len < max_model_len:
            logger.warning(
                "The KV cache (%d blocks of %d tokens) holds fewer tokens than max_model_len=%d: "
                "requests stop with finish_reason='length' at %d tokens.",
                num_gpu_blocks, self.block_size, max_model_len, self.max_seq_len,
            )
        self.requests: dict[str, Request] = {}
        """Every unfinished request (waiting, running or preempted) by request_id."""
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        """Running requests in admission order (the last one is preempted first under fcfs)."""
        self._finished_req_ids: list[str] = []
        self._step_id = 0
        self._preemption_logger = PreemptionLogger(preemption_log_interval_s)
        self.num_preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps_total = 0

    # ------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a new request; `InvalidRequestError` if it could never run."""
        self._check_request(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Finish these requests as aborted and free their blocks now; unknown ids are ignored."""
        aborted = []
        for req_id in req_ids:
            request = self.requests.pop(req_id, None)
            if request is None:
                continue
            request.finish(RequestStatus.FINISHED_ABORTED)
            self.kv_cache_manager.free(request)
            self._finished_req_ids.append(req_id)
            aborted.append(request)
        if aborted:
            gone = {r.request_id for r in aborted}
            self.running = [r for r in self.running if r.request_id not in gone]
            self.waiting.remove_requests(gone)
        return aborted

    def abort_client(self, client_id: bytes) -> list[Request]:
        """Abort every request of one host (it said goodbye or died)."""
        return self.abort_requests([r.request_id for r in self.requests.values() if r.client_id == client_id])

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> protocol.SchedulerStats:
        kv = self.kv_cache_manager
        return protocol.SchedulerStats(
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting),
            num_gpu_blocks=kv.num_gpu_blocks,
            num_used_blocks=kv.num_used_blocks,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps_total=self.num_steps_total,
        )

    # ------------------------------------------------------------ schedule
    def schedule(self) -> protocol.SchedulerOutput:
        """Build the next step.

        Send every output to the workers, even one with no tokens scheduled:
        it carries `finished_req_ids` and `preempted_req_ids` only once.
        """
        step = _Step(self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted_req_ids:
            self._schedule_waiting(step)
        total = sum(step.num_scheduled_tokens.values())
        out = protocol.SchedulerOutput(
            step_id=self._step_id,
            new_reqs=step.new_reqs,
            cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=step.preempted_req_ids,
        )
        self._finished_req_ids = []
        self._step_id += 1
        if total:
            self.num_steps_total += 1
        return out

    def _schedule_running(self, step: _Step) -> None:
        # The hot loop of a decode step: names bound once, one allocate_slots call per request.
        allocate_slots = self.kv_cache_manager.allocate_slots
        running = self.running
        cached_reqs = step.cached_reqs
        num_scheduled_tokens = step.num_scheduled_tokens
        CachedRequestData = protocol.CachedRequestData
        index = 0
        while index < len(running) and step.budget > 0:
            request = running[index]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new != 1:
                num_new = self._chunk(num_new, step.budget)
            assert num_new > 0, request
            new_block_ids = allocate_slots(request, num_new)
            if new_block_ids is None:
                new_block_ids = self._preempt_until_allocated(request, num_new, index, step)
                if new_block_ids is None:
                    continue  # the request preempted itself; the running list shrank
            cached_reqs.append(CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens))
            num_scheduled_tokens[request.request_id] = num_new
            step.budget -= num_new
            index += 1

    def _preempt_until_allocated(self, request: Request, num_new: int, index: int, step: _Step) -> list[int] | None:
        """Preempt running requests (maybe `request` itself) until its slots fit; None if it was the victim."""
        while True:
            victim = self.running.pop(self._victim_index(index))
            self._preempt(victim)
            step.preempted_req_ids.append(victim.request_id)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids

    def _victim_index(self, first_unscheduled: int) -> int:
        """The request to preempt, among those not scheduled yet in this step."""
        if self.policy == "fcfs":
            return len(self.running) - 1
        candidates = range(first_unscheduled, len(self.running))
        return max(candidates, key=lambda i: (self.running[i].priority, self.running[i].arrival_time, i))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.add_preempted(request)
        self.num_preemptions_total += 1
        self._preemption_logger.record(request.request_id, self.config.preemption_mode, self.num_preemptions_total)

    def _schedule_waiting(self, step: _Step) -> None:
        kv = self.kv_cache_manager
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = self._admission_chunk(request.num_tokens - num_hit_tokens, step.budget)
            if num_new == 0:
                break
            block_ids = kv.allocate_slots(request, num_new, hits)
            if block_ids is None:
                break
            self.waiting.pop()
            self._admit(request, num_hit_tokens)
            step.new_reqs.append(
                protocol.NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    params=request.params,
                    block_ids=block_ids,
                    num_computed_tokens=num_hit_tokens,
                )
            )
            step.num_scheduled_tokens[request.request_id] = num_new
            step.budget -= num_new

    def _chunk(self, num_remaining: int, budget: int) -> int:
        """Tokens a request computes this step: capped by the budget and the long-prefill threshold."""
        threshold = self.long_prefill_token_threshold
        if threshold > 0 and self.enable_chunked_prefill:
            num_remaining = min(num_remaining, threshold)
        return min(num_remaining, budget)

    def _admission_chunk(self, num_remaining: int, budget: int) -> int:
        """Like `_chunk`, but 0 (wait) when chunking is off and the rest does not fit this step.

        A request whose rest exceeds even an empty step (only a request resumed
        after preemption, whose outputs grew it) is chunked anyway, or it
        could never run again.
        """
        if self.enable_chunked_prefill or num_remaining <= budget:
            return self._chunk(num_remaining, budget)
        if num_remaining <= self.max_num_batched_tokens:
            return 0
        return budget

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
        self.running.append(request)

    # ------------------------------------------------------------ update
    def update_from_output(
        self, sched_out: protocol.SchedulerOutput, runner_out: protocol.ModelRunnerOutput
    ) -> list[tuple[bytes, protocol.RequestOutputDelta]]:
        """Apply one step's results; one (client_id, delta) per request with new tokens or finished.

        Requests aborted since `schedule()` are skipped.
        """
        assert runner_out.step_id == sched_out.step_id, (runner_out.step_id, sched_out.step_id)
        sampled = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids))
        outputs: list[tuple[bytes, protocol.RequestOutputDelta]] = []
        # The hot loop of a decode step: names bound once.
        requests, advance, max_seq_len = self.requests, self._advance, self.max_seq_len
        RequestOutputDelta, RUNNING = protocol.RequestOutputDelta, RequestStatus.RUNNING
        any_finished = False
        for req_id, num_scheduled in sched_out.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None or request.status is not RUNNING:
                continue
            if not advance(request, num_scheduled):
                continue  # a prefill chunk: nothing sampled
            token_ids = sampled.get(req_id)
            assert token_ids, f"the worker sampled no token for {req_id} at the end of its tokens"
            first = not request.output_token_ids
            new_token_ids = request.append_sampled_tokens(token_ids, max_seq_len)
            self.generation_tokens_total += len(new_token_ids)
            delta = RequestOutputDelta(
                req_id, new_token_ids, request.finish_reason, request.stop_reason,
                request.num_cached_tokens if first else 0,
            )
            outputs.append((request.client_id, delta))
            if request.finish_reason is not None:
                self._free_finished(request)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.status.is_finished]
        return outputs

    def _advance(self, request: Request, num_scheduled: int) -> bool:
        """Count `num_scheduled` tokens as computed and cache blocks they filled; True if all known tokens are."""
        before = request.num_computed_tokens
        after = request.num_computed_tokens = before + num_scheduled
        if before < request.num_prompt_tokens:
            self.prompt_tokens_total += min(after, request.num_prompt_tokens) - before
        if after // self.block_size > before // self.block_size:
            self.kv_cache_manager.cache_full_blocks(request)
        return after >= request.num_tokens

    def _free_finished(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)

    # ------------------------------------------------------------ checks
    def _check_request(self, request: Request) -> None:
        num_prompt = request.num_prompt_tokens
        assert request.status is RequestStatus.WAITING and not request.output_token_ids, request
        if num_prompt == 0:
            raise InvalidRequestError("prompt", "is empty: at least one token is needed")
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already used by an unfinished request")
        if num_prompt > self.max_model_len - 1:
            raise InvalidRequestError(
                "prompt",
                f"{num_prompt} tokens is too long: max_model_len={self.max_model_len} leaves room for "
                f"at most {self.max_model_len - 1} prompt tokens and one generated token",
            )
        capacity = self.kv_cache_manager.num_gpu_blocks * self.block_size
        if num_prompt > capacity - 1:
            raise InvalidRequestError(
                "prompt",
                f"{num_prompt} tokens do not fit in the whole KV cache ({capacity} tokens, one of which "
                f"the first generated token needs): shorten the prompt, or raise gpu_memory_utilization, "
                f"num_gpu_blocks_override or tensor_parallel_size",
            )
        if not self.enable_chunked_prefill and num_prompt > self.max_num_batched_tokens:
            raise InvalidRequestError(
                "prompt",
                f"{num_prompt} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens} with "
                f"enable_chunked_prefill=False: enable chunked prefill or raise max_num_batched_tokens",
            )


def _token_budget(config: EngineConfig, max_model_len: int) -> int:
    """`resolved_max_num_batched_tokens`, using the model's max_model_len when the config has none yet."""
    if config.max_num_batched_tokens is None and not config.enable_chunked_prefill:
        return max(max_model_len, config.max_num_seqs)
    return config.resolved_max_num_batched_tokens
