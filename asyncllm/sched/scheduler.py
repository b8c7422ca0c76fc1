"""`Scheduler`: continuous batching over a paged KV cache (docs/scheduling.md).

One `schedule()` builds one step under `max_num_batched_tokens` tokens and
`max_num_seqs` requests:

0. 'priority' only: when the running requests' next tokens need more blocks
   than are free, the fewest of them, lowest priority and latest arrival first
   (vLLM's victims), are preempted, and nobody is admitted; else, when the
   first waiting request would not be admitted, the fewest lower-priority
   running requests (in that order) after which it would be; none when no
   number would do. Drafts get only the free blocks no next token needs.
1. RUNNING requests first, in admission order (as vLLM V1, under both
   policies): decodes and prefills under way. When no block is free for one
   (under fcfs; step 0 leaves none short under priority), a request not yet
   served is preempted (maybe itself; `victim_index`: the last under fcfs):
   by recompute, or by swap to the CPU `SwapSpace` (recompute when it is
   full), and queued again.
2. If step 1 preempted nothing, WAITING requests in queue order with what is
   left: prefix-cache hits (plus a swapped request's swap-in), then the prompt
   or a chunk of it, until blocks, budget or seats run out.

Steps 0 and 2 are in asyncllm/sched/schedule_waiting.py; step 1 schedules the
decodes in bulk (asyncllm/sched/decode_step.py), the rest one request at a time
(asyncllm/sched/schedule_each.py).

Every swap-out of a step is decided before any swap-in, and workers copy out,
then in, then run the forward: a GPU block freed by a swap-out may be reused
in the same step, a CPU block freed by a swap-in only in a later one.

A block this step fills enters the prefix cache when it is scheduled, so a
waiting request admitted after it in the same step (the n samples of one
prompt) hits it and computes only the rest (docs/scheduling.md).

`update_from_output()` applies what the workers computed and sampled and
returns the deltas for the hosts; `finish_expired_requests()` ends timed-out
requests between steps. Each is O(scheduled requests) (O(1) when no deadline
is due): nothing walks the block pool. The worker samples a request when the
step reaches the end of its known tokens, so schedule, run, update alternate.

Pipeline micro-batches (``pipeline_parallel_size`` P > 1 with the core's
overlapped steps): a step holds at most 1/P of the running requests (and of
the seats the queue could fill, with its admissions), and a request whose
sampled token is still in flight (a step scheduled, its output not applied)
is skipped, so the steps in flight hold disjoint requests and the stages run
P of them at once (docs/parallelism.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.kv.manager import KVCacheManager
from asyncllm.kv.offload import CPUPrefixCache
from asyncllm.kv.state_checkpoints import StateCheckpoints
from asyncllm.kv.swap import SwapSpace
from asyncllm.protocol import EngineCoreEventType
from asyncllm.sched.admission import AdmissionGroups, check_queue_capacity, check_request, kv_size_fields
from asyncllm.sched.chunking import ChunkPolicy, token_budget
from asyncllm.sched.deadlines import DeadlineHeap
from asyncllm.sched.decode_step import schedule_decodes, step_record, update_decodes
from asyncllm.sched.logprobs import attach_logprobs
from asyncllm.sched.preemption import PreemptionLogger, Preemptor
from asyncllm.sched.queue import create_request_queue
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.rows import RequestRows, StepRows
from asyncllm.sched.schedule_each import schedule_each
from asyncllm.sched.schedule_waiting import preempt_for_priority, schedule_waiting
from asyncllm.sched.stats import scheduler_stats
from asyncllm.sched.step_outputs import StepOutputs
from asyncllm.sched.update_each import update_each
from asyncllm.spec.draft_model import DraftModelProposer
from asyncllm.spec.ngram import NgramProposer
from asyncllm.spec.stats import SpecDecodingStats

__all__ = ["Scheduler", "PreemptionLogger"]

logger = logging.getLogger("asyncllm.sched")


class _Step:
    """What one `schedule()` call has decided so far."""

    __slots__ = (
        "budget", "num_scheduled_tokens", "new_reqs", "cached_reqs", "preempted_req_ids",
        "blocks_to_swap_out", "blocks_to_swap_in", "spec_token_ids", "bulk", "num_bulk", "max_running", "max_reqs",
        "draft_blocks",
    )

    def __init__(self, budget: int, max_running: int | None = None, max_reqs: int | None = None) -> None:
        self.budget = budget
        self.max_running = max_running
        """Running requests this step may hold (pipeline micro-batches); None: no limit but the budget."""
        self.max_reqs = max_reqs
        """Requests this step may hold, the admitted ones included (pipeline micro-batches); None: no limit but the
        budget and the seats."""
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[protocol.NewRequestData] = []
        self.cached_reqs = protocol.CachedRequestData()
        self.preempted_req_ids: list[str] = []
        self.blocks_to_swap_out: list[list[int]] = []
        self.blocks_to_swap_in: list[list[int]] = []
        self.spec_token_ids: dict[str, list[int]] = {}
        self.bulk: StepRows | None = None
        """The running list with its rows, when `schedule_decodes` scheduled its first `num_bulk` requests."""
        self.num_bulk = 0
        self.draft_blocks: int | None = None
        """Under 'priority' with drafts: the free blocks no running request's next tokens need, all drafts may take."""


class Scheduler:
    """Decides every step which requests run and how many tokens each computes."""

    def __init__(
        self,
        config: EngineConfig,
        num_gpu_blocks: int,
        max_model_len: int,
        preemption_log_interval_s: float = 5.0,
        num_cpu_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
        state_checkpoints: int = 0,
        num_offload_blocks: int = 0,
        kv_budget_field: str = "",
    ) -> None:
        """``state_checkpoints``: a hybrid model's checkpoint slots (asyncllm/kv/state_checkpoints.py);
        ``num_offload_blocks``: the CPU prefix-cache tier's blocks, after the ``num_cpu_blocks`` of the swap space
        (kv_offloading_size; asyncllm/kv/offload.py); ``kv_budget_field``: what sized the KV cache (named in advice)."""
        self.config = config
        self.kv_size = kv_size_fields(config, kv_budget_field)
        self.block_size: int = config.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs: int = config.max_num_seqs
        self.max_num_batched_tokens = token_budget(config, max_model_len)
        self.enable_chunked_prefill: bool = config.enable_chunked_prefill
        self.chunking = ChunkPolicy(self.max_num_batched_tokens, self.enable_chunked_prefill,
                                    config.long_prefill_token_threshold)
        self.policy: str = config.scheduling_policy
        self.max_loras: int = config.max_loras if config.enable_lora else 0
        """Adapters among the running requests at most (0: LoRA off)."""
        self.pinned_loras: Iterable[int] = frozenset()  # pin_lora's adapters (the core's): each holds a slot
        checkpoints = (StateCheckpoints(config.mamba_block_size, self.block_size, state_checkpoints)
                       if state_checkpoints and config.enable_prefix_caching else None)
        offload = CPUPrefixCache(num_cpu_blocks, num_offload_blocks) if num_offload_blocks else None
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, self.block_size, config.enable_prefix_caching,
                                               checkpoints, offload)
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
        self.admission_groups = AdmissionGroups()  # the queue's limits admit a group's requests together
        self.running: list[Request] = []
        """Running requests in admission order; victims by `victim_index` (asyncllm/sched/preemption.py)."""
        self.rows = RequestRows(config.max_num_seqs)
        """The running requests' counters (asyncllm/sched/rows.py): each holds a row while in `running`."""
        self.running_order: StepRows | None = None
        """`running` with its rows, kept while it holds the same requests (asyncllm/sched/decode_step.py)."""
        self.step_records: dict[int, StepRows] = {}
        """Each step scheduled and not yet updated: its requests, rows and token counts, by step id."""
        self.swap_space = SwapSpace(num_cpu_blocks, self.block_size) if config.preemption_mode == "swap" else None
        """The CPU blocks of swapped-out requests (preemption_mode='swap' only)."""
        self.deadlines = DeadlineHeap()
        self._clock = clock
        """time.monotonic; deadlines are measured from add_request on this clock."""
        self._finished_req_ids: list[str] = []
        self._step_id = 0
        self.preemptor = Preemptor(config.preemption_mode, self.kv_cache_manager, self.swap_space, self.waiting,
                                   preemption_log_interval_s)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps_total = 0
        self.mm_encoder_cache_queries = 0
        """Images the workers looked up in their encoder cache (rank 0's counts, from `ModelRunnerOutput`)."""
        self.mm_encoder_cache_hits = 0
        spec = config.scheduler_config.speculative
        self.proposer: NgramProposer | DraftModelProposer | None = None
        """Speculative decoding's drafts (asyncllm/spec/): n-grams, or the draft model's from the workers; None when off."""
        if spec is not None:
            self.proposer = DraftModelProposer() if spec.uses_draft_model else NgramProposer(spec)
        self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens if spec is not None else 0)
        overlapped = config.async_scheduling and spec is None  # as the engine core decides (engine/core.py)
        self.concurrent_batches: int = config.pipeline_parallel_size if overlapped else 1
        """Steps in flight at once with disjoint requests: the pipeline's stages (1: every step takes all it can)."""

    # ------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a new request; `InvalidRequestError` if it could never run, `EngineOverloadedError` if the queue is full.

        A request's `timeout` counts from now (when the core received it).
        """
        self._check_request(request)
        request.cap_length(self.max_seq_len)  # then one length check per token covers max_tokens and max_seq_len
        if self.proposer is not None and request.pooling is None:  # every sampling request may be drafted
            request.draft_buffer = bytearray()
        config = self.config
        check_queue_capacity(self.waiting, request, self.admission_groups, config.max_num_queued_requests,
                             config.max_num_queued_tokens)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.timeout is not None:
            self.deadlines.add(request, self._clock() + request.timeout, len(self.requests))
        if not any(event.type == EngineCoreEventType.QUEUED for event in request.events or ()):
            request.record_event(EngineCoreEventType.QUEUED)  # (a grammar's request: queued when it was parked)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Finish these requests as aborted and free their blocks now; unknown ids are ignored."""
        aborted = [request for request in map(self.requests.get, dict.fromkeys(req_ids)) if request is not None]
        self._finish_unscheduled(aborted, RequestStatus.FINISHED_ABORTED)
        return aborted

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        """Finish these requests between steps and free their blocks now (a structured request's grammar ended)."""
        self._finish_unscheduled([r for r in map(self.requests.get, dict.fromkeys(req_ids)) if r is not None], status)

    def fail_requests(self, failed: dict[str, str]) -> list[tuple[bytes, protocol.RequestOutputDelta]]:
        """End requests the workers could not run (`ModelRunnerOutput.failed_requests`) with their error, as
        aborts: call before the step's `update_from_output`, which then drops what they sampled."""
        if not failed:
            return []
        firsts = {req_id: r.num_computed_tokens // self.block_size
                  for req_id, r in zip(failed, map(self.requests.get, failed)) if r is not None}
        # and the holders of their blocks not computed before the failing step (prefix hits on blocks registered
        # when scheduled, e.g. a sibling sample's): that KV is not right either
        failed = {**failed, **{h: failed[src] for h, src in self.kv_cache_manager.holders_of(firsts).items()}}
        requests = [r for r in map(self.requests.get, failed) if r is not None]
        self._finish_unscheduled(requests, RequestStatus.FINISHED_ABORTED)
        return [(r.client_id, protocol.RequestOutputDelta(r.request_id, [], "abort", error=failed[r.request_id],
                                                          error_type="InvalidRequestError")) for r in requests]

    def finish_expired_requests(self) -> list[tuple[bytes, protocol.RequestOutputDelta]]:
        """End requests whose timeout passed (finish_reason 'timeout'); one delta per request.

        Call between steps, never between `schedule()` and `update_from_output()`.
        """
        if not self.deadlines:
            return []
        expired = self.deadlines.pop_expired(self._clock())
        self._finish_unscheduled(expired, RequestStatus.FINISHED_TIMEOUT)
        return [
            (r.client_id, protocol.RequestOutputDelta(r.request_id, [], r.finish_reason, events=r.take_events()))
            for r in expired
        ]

    def _finish_unscheduled(self, requests: list[Request], status: RequestStatus) -> None:
        """Finish requests outside a step, wherever they are, and free their GPU and CPU blocks now."""
        if not requests:
            return
        gone = {r.request_id for r in requests}
        if any(r.status is RequestStatus.RUNNING for r in requests):  # only those are in `running`: O(1) otherwise
            self.running = [r for r in self.running if r.request_id not in gone]
        for request in requests:
            del self.requests[request.request_id]
            if self.rows.holds(request):
                self.rows.detach(request)
            request.finish(status)
            self.kv_cache_manager.free(request)
            if self.swap_space is not None:
                self.swap_space.free(request.request_id)
            self._finished_req_ids.append(request.request_id)
        self.waiting.remove_requests(gone)

    def abort_client(self, client_id: bytes) -> list[Request]:
        """Abort every request of one host (it said goodbye or died)."""
        return self.abort_requests([r.request_id for r in self.requests.values() if r.client_id == client_id])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (`BlockPool.reset_prefix_cache`); the hit counters keep counting."""
        self.kv_cache_manager.reset_prefix_cache()

    def forget_on_workers(self, req_ids: Iterable[str]) -> None:
        """The next step tells the workers to drop these requests' rows (as finished ones'); a request that runs
        again comes back to them as new (asyncllm/sched/recovery.py, after a weight update)."""
        self._finished_req_ids.extend(req_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> protocol.SchedulerStats:
        return scheduler_stats(self)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> protocol.SchedulerOutput:
        """Build the next step.

        Send every output to the workers, even one with no tokens scheduled:
        it carries `finished_req_ids` and `preempted_req_ids` only once.
        """
        step = _Step(self.max_num_batched_tokens, *self._micro_batch_size())
        short = self.policy == "priority" and bool(self.running) and preempt_for_priority(self, step)
        num_preempted = len(step.preempted_req_ids)
        self._schedule_running(step)
        if not short and len(step.preempted_req_ids) == num_preempted:
            schedule_waiting(self, step)
        total = self.max_num_batched_tokens - step.budget  # every scheduled token was taken from the budget
        offloads, loads = self.kv_cache_manager.take_offload_copies()  # the CPU tier's (asyncllm/kv/offload.py)
        out = protocol.SchedulerOutput(
            step_id=self._step_id,
            new_reqs=step.new_reqs,
            cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=step.preempted_req_ids,
            blocks_to_swap_out=step.blocks_to_swap_out + offloads,
            blocks_to_swap_in=step.blocks_to_swap_in + loads,
            spec_token_ids=step.spec_token_ids,
        )
        if self.kv_cache_manager.checkpoints is not None:
            self.kv_cache_manager.checkpoints.plan(out, self.requests)
        self._finished_req_ids = []
        if total:  # an empty step is never updated (the core does not run it): no record
            self.step_records[out.step_id] = step_record(self, out, step.bulk, step.num_bulk)
            self.num_steps_total += 1
        self._step_id += 1
        return out

    def _micro_batch_size(self) -> tuple[int | None, int | None]:
        """A pipeline micro-batch's running requests and requests at most: 1/P of the running ones, and 1/P of the
        seats the queue could fill (when its requests can be admitted); None, None without micro-batches.

        The running ones alone set the first: waiting requests that find no blocks must not widen a micro-batch
        to every running request, which would leave the next step empty.
        """
        stages = self.concurrent_batches
        if stages == 1:
            return None, None
        max_running = max(1, -(-len(self.running) // stages))
        seats = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        return max_running, max(max_running, -(-seats // stages))

    def _schedule_running(self, step: _Step) -> None:
        """The decodes up to the first prefill under way in bulk (asyncllm/sched/decode_step.py), the rest of the
        running requests one at a time (asyncllm/sched/schedule_each.py)."""
        start = schedule_decodes(self, step) if self.proposer is None and step.max_running is None else 0
        if start < len(self.running):
            schedule_each(self, step, start)

    @property
    def num_preemptions_total(self) -> int:
        return self.preemptor.num_preemptions_total

    # ------------------------------------------------------------ update
    def update_from_output(
        self, sched_out: protocol.SchedulerOutput, runner_out: protocol.ModelRunnerOutput
    ) -> StepOutputs:
        """Apply one step's results; an output for each request with new tokens or finished.

        A request's one new token with nothing else to report goes into the
        per-host token lists of `StepOutputs`, any other output is a full delta.
        Requests aborted since `schedule()` are skipped.
        """
        assert runner_out.step_id == sched_out.step_id, (runner_out.step_id, sched_out.step_id)
        self.mm_encoder_cache_queries += runner_out.mm_encoder_cache_queries
        self.mm_encoder_cache_hits += runner_out.mm_encoder_cache_hits
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.update(runner_out.draft_token_ids)
        record = self._pop_step_record(sched_out.step_id)
        step_outputs = update_decodes(self, sched_out, runner_out, record) if record is not None else None
        if step_outputs is None:
            step_outputs = update_each(self, sched_out, runner_out)
        if runner_out.logprobs or runner_out.prompt_logprobs or runner_out.embeddings:
            attach_logprobs(step_outputs.deltas, runner_out, self.requests)
        return step_outputs

    def _pop_step_record(self, step_id: int) -> StepRows | None:
        """The step's record; records of older steps (lost with failed workers) are dropped."""
        records = self.step_records
        while records and next(iter(records)) < step_id:
            del records[next(iter(records))]
        return records.pop(step_id, None)

    def free_finished(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.rows.detach(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)

    # ------------------------------------------------------------ checks
    def _check_request(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING and request.num_tokens == request.num_prompt_tokens, request
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already used by an unfinished request")
        if request.priority and self.policy != "priority":  # as vLLM: a priority the policy would ignore is an error
            raise InvalidRequestError("priority", f"is {request.priority}, but this engine schedules {self.policy!r}: "
                                                  "start it with scheduling_policy='priority'")
        if request.lora_int_id and not self.max_loras:
            raise InvalidRequestError("lora_request", "this engine serves no LoRA adapters: start it with enable_lora=True")
        capacity = self.kv_cache_manager.num_gpu_blocks * self.block_size
        check_request(request, self.max_model_len, capacity, self.chunking.splits_prompts, self.max_num_batched_tokens,
                      self.kv_size)
