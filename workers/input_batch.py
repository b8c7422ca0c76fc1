"""A worker's persistent per-request rows, and the flattened inputs of one step.

Following vLLM's model-runner-v2 notes, request state and step inputs are
kept apart. `InputBatch` holds one row per request the worker knows (token
ids, computed count, block-table row, sampling settings); each step applies
only the scheduler's diffs to those rows (drop finished and preempted ids,
add new requests, append new block ids), then gathers the scheduled rows
into per-step buffers (`RequestState` and `StepInputs`: workers/input_types.py).
The block table is persistent on the host and on the device
(`workers/block_table.py`): both take the same diffs, and a step gathers its
rows on the device.

Per-step buffers are allocated once at their largest size: a host buffer
(pinned on CUDA) mirrored by a device buffer, so inputs keep fixed device
addresses (what CUDA graphs need) and the copy is ``non_blocking``. A step's
tensors are views of those buffers: they are valid until the next
`prepare_inputs`, which first waits for the previous step's host-to-device
copies (a step that samples nothing never synchronises on its own).
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.workers.block_table import BlockTable
from asyncllm.workers.generation_rules import GenerationRules
from asyncllm.workers.input_types import RequestState, StepInputs
from asyncllm.workers.logits_processors import (
    LogitsProcessorsMetadata, RowLogitsParams, build_logits_processors_metadata,
)
from asyncllm.workers.logprobs import LogprobsMetadata, PromptLogprobsJob, plan_prompt_logprobs
from asyncllm.workers.sampler import GREEDY_EPS, SamplingMetadata
from asyncllm.workers.spec_decode import DraftedRequest, DraftPosition, exhausted_requests, plan_drafted
from asyncllm.workers.step_staging import StepLayout, StepStaging, pad_decode, padded_size
from asyncllm.workers.token_feedback import PendingTokens, TokenFeedback

__all__ = ["InputBatch"]


class InputBatch:
    """Persistent request rows plus the per-step buffers they are gathered into."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self.prompt_logprobs_req_ids: set[str] = set()
        """Requests that asked for prompt logprobs and have not sampled yet."""
        self._num_logits_params = 0
        self._num_logprobs = 0
        self._num_random = 0
        """Rows with logits processors / logprobs / a sampling temperature: when 0, a step skips gathering them."""
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(max_num_reqs, max_blocks, device)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self._init_sampling_rows(max_num_reqs)
        self._init_step_buffers(max_num_reqs, max_num_batched_tokens, max_blocks)
        self._copies_done = torch.cuda.Event() if device.type == "cuda" else None
        self.feedback = TokenFeedback(max_num_reqs, device)
        """The last deferred step's sampled ids, for the next step's inputs (workers/token_feedback.py)."""
        self.generation_rules: GenerationRules | None = None
        """The model's generation_config rules (suppressed ids, Whisper's timestamps), set by the model runner."""

    def _init_sampling_rows(self, num_rows: int) -> None:
        self.temperature = np.zeros(num_rows, np.float32)
        self.top_k = np.zeros(num_rows, np.int64)
        self.top_p = np.ones(num_rows, np.float32)
        self.min_p = np.zeros(num_rows, np.float32)

    def _init_step_buffers(self, max_reqs: int, max_tokens: int, max_blocks: int) -> None:
        device = self.device
        self.staging = StepStaging(max(max_tokens, max_reqs), max_reqs, device)
        """The step's integer inputs, copied to the device in one copy (workers/step_staging.py)."""
        self.layout = self.staging.layout(1, 1)
        """The last step's layout: its host sections are what the step's device tensors were copied from."""
        self.graph_sizes: list[int] = []
        """The CUDA graphs' capture sizes: a decode batch is laid out padded to the smallest that holds it, which is
        the layout that size's graph reads (`pad_decode`)."""
        self.keeps_states = False
        """The model keeps per-request recurrent states by row (linear attention): the step's metadata lists the rows
        on the host too (`AttentionMetadata.request_rows_cpu`)."""
        self.block_tables = torch.zeros((max_reqs, max_blocks), dtype=torch.int32, device=device)
        """The step's block-table rows, gathered on the device (`BlockTable.gather`); nothing else writes them."""
        self._gathered: tuple[int, list[str], torch.Tensor] | None = None
        """(table version, requests, their rows of `block_tables`) of the last gather."""

    # ------------------------------------------------------------ state diffs
    def update_states(self, sched_out: SchedulerOutput) -> None:
        """Apply one step's diffs: drop, then add, then update."""
        for req_id in (*sched_out.finished_req_ids, *sched_out.preempted_req_ids):
            self.remove_request(req_id)
        for new in sched_out.new_reqs:
            self.add_request(new)
        self._update_requests(sched_out.cached_reqs)

    def add_request(self, new: NewRequestData) -> None:
        self.remove_request(new.req_id)  # a resumed request replaces any stale row
        row = self._take_row()
        self.requests[new.req_id] = RequestState(
            req_id=new.req_id,
            row=row,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            num_computed_tokens=new.num_computed_tokens,
            params=new.params,
            logits_params=RowLogitsParams.from_params(new.params, new.eos_token_ids),
        )
        if new.params.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens:
            self.prompt_logprobs_req_ids.add(new.req_id)
        if self.generation_rules is not None:
            self.generation_rules.add(row, new.token_ids, new.num_prompt_tokens)
        self._count_extras(self.requests[new.req_id], 1)
        self.block_table.append(row, new.block_ids)
        params = new.params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p

    def remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        self.prompt_logprobs_req_ids.discard(req_id)
        if state is not None:
            if self.generation_rules is not None:
                self.generation_rules.discard(state.row)
            self._count_extras(state, -1)
            self.block_table.clear(state.row)
            self._free_rows.append(state.row)

    @property
    def num_logits_params_rows(self) -> int:
        """Rows with logit_bias, min_tokens or penalties, or Whisper's timestamps (their processors read output
        tokens on the host)."""
        timestamps = self.generation_rules.timestamp_rows if self.generation_rules is not None else ()
        return self._num_logits_params + len(timestamps)

    def _count_extras(self, state: RequestState, sign: int) -> None:
        self._num_logits_params += sign * (state.logits_params is not None)
        self._num_logprobs += sign * (state.params.logprobs is not None)
        self._num_random += sign * (state.params.temperature >= GREEDY_EPS)

    def _update_requests(self, cached: CachedRequestData) -> None:
        requests = self.requests
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            requests[req_id].num_computed_tokens = num_computed
        for req_id, new_block_ids in cached.new_block_ids.items():
            self.block_table.append(requests[req_id].row, new_block_ids)

    def _take_row(self) -> int:
        """A free row; rows grow past max_num_reqs rather than fail (the table is host memory)."""
        if not self._free_rows:
            old = len(self.temperature)
            new = 2 * old
            self.block_table.grow(new)
            for name in ("temperature", "top_k", "top_p", "min_p"):
                array = getattr(self, name)
                fill = 1.0 if name == "top_p" else 0
                setattr(self, name, np.concatenate([array, np.full(new - old, fill, array.dtype)]))
            self._free_rows = list(range(new - 1, old - 1, -1))
        return self._free_rows.pop()

    # ------------------------------------------------------------ step inputs
    def prepare_inputs(self, sched_out: SchedulerOutput) -> StepInputs:
        """Gather the scheduled rows into the flattened step and copy it to the device."""
        req_ids = list(sched_out.num_scheduled_tokens)
        num_reqs = len(req_ids)
        assert 0 < num_reqs <= self.max_num_reqs, num_reqs
        states = [self.requests[req_id] for req_id in req_ids]
        for req_id, drafts in sched_out.spec_token_ids.items():  # inputs like known tokens until `finish_step`
            self.requests[req_id].token_ids += drafts
        # numpy calls cost microseconds each even on one row: a batch-1 decode step's host time is mostly their count
        assert 0 not in sched_out.num_scheduled_tokens.values(), sched_out.num_scheduled_tokens
        num_scheduled = np.fromiter(sched_out.num_scheduled_tokens.values(), np.int64, num_reqs)
        total = sum(sched_out.num_scheduled_tokens.values())
        assert total <= self.max_num_batched_tokens, total
        graph_size = padded_size(num_reqs, self.graph_sizes) if total == num_reqs and self.graph_sizes else None
        layout = self.layout = self.staging.layout(graph_size or total, graph_size or num_reqs)
        host = layout.host
        if self._copies_done is not None:
            self._copies_done.synchronize()  # the last step's copy may still read the pinned buffer
        computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs)
        num_tokens = np.fromiter(map(len, [s.token_ids for s in states]), np.int64, num_reqs)
        seq_lens = computed + num_scheduled
        unseen = num_tokens - seq_lens  # known tokens past this step's: none for a request that samples
        assert unseen.min() >= 0, [(s.req_id, n) for s, n in zip(states, seq_lens) if n > s.num_tokens]
        query_start_loc = host["query_start_loc"][: num_reqs + 1]
        query_start_loc[0] = 0
        np.add.accumulate(num_scheduled, out=query_start_loc[1:], dtype=query_start_loc.dtype)
        host["seq_lens"][:num_reqs] = seq_lens
        rows = host["request_rows"][:num_reqs]
        rows[:] = np.fromiter((s.row for s in states), np.int64, num_reqs)
        self._write_token_ids(host["input_ids"], states, query_start_loc, computed, seq_lens)
        self._write_positions_and_slots(host, rows, num_scheduled, computed, query_start_loc)
        if graph_size is not None and graph_size > num_reqs:
            pad_decode(host, num_reqs)
        sampling = (unseen == 0).nonzero()[0]  # the step reaches the end of their known tokens
        sample_indices = sampling.tolist()
        num_sampling = len(sample_indices)
        logits_indices = host["logits_indices"]
        logits_indices[:num_sampling] = query_start_loc[1:][sampling] - 1
        sampling_states = list(states) if num_sampling == num_reqs else [states[i] for i in sample_indices]
        positions = num_tokens[sampling].tolist()
        drafted: list[DraftedRequest] = []
        if sched_out.spec_token_ids:  # the draft positions' rows follow the usual ones
            drafted, extra = plan_drafted(req_ids, sample_indices, sched_out.spec_token_ids, query_start_loc)
            logits_indices[num_sampling : num_sampling + len(extra)] = extra
            for request in drafted:
                state, k = sampling_states[request.sample], len(request.drafts)
                if state.logits_params is None:
                    sampling_states += [state] * k
                else:  # its processors see each position's outputs so far
                    sampling_states[request.sample] = DraftPosition.of(state, k, k)
                    sampling_states += [DraftPosition.of(state, k, j) for j in range(k)]
                positions += range(state.num_tokens - k, state.num_tokens)
        sampled_rows = rows if len(sampling_states) == num_reqs and not drafted else None  # the batch's own rows
        sampling_metadata = self._sampling_metadata(sampling_states, positions, sampled_rows)
        every_token_samples = num_sampling == total and not drafted  # `StepInputs.every_token_samples`
        num_logits_rows = 0 if every_token_samples else len(positions)
        self.staging.to_device(layout, num_logits_rows)  # the step's one host-to-device copy
        inputs = self._step_inputs(layout, req_ids, total, sample_indices, sampling_metadata, num_logits_rows)
        inputs.drafted, inputs.graph_size = drafted, graph_size
        if sampling_metadata.logits_processors is not None and sampling_metadata.logits_processors.exhausted:
            inputs.failed, inputs.exhausted_drafts = exhausted_requests(
                req_ids, sample_indices, drafted, sampling_metadata.logits_processors.exhausted)
        if drafted and self.keeps_states:  # the state layers keep each draft's states (asyncllm/models/row_states.py)
            inputs.attn_metadata.state_drafts = [(int(rows[sample_indices[r.sample]]), len(r.drafts)) for r in drafted]
        if sched_out.state_loads or sched_out.state_saves:
            _plan_state_checkpoints(inputs.attn_metadata, sched_out, self.requests)
        if self.feedback.pending is not None:
            self.feedback.fill(host["input_ids"], inputs.input_ids, query_start_loc, computed,
                               [s.token_ids for s in states])
        if self._copies_done is not None:
            self._copies_done.record()
        if self.prompt_logprobs_req_ids:
            inputs.prompt_logprobs_jobs = self._prompt_logprobs_jobs(states, computed, num_scheduled, query_start_loc)
        return inputs

    def _prompt_logprobs_jobs(
        self, states: list[RequestState], computed: np.ndarray, num_scheduled: np.ndarray, query_start_loc: np.ndarray
    ) -> list[PromptLogprobsJob]:
        jobs = []
        for i, state in enumerate(states):
            if state.req_id in self.prompt_logprobs_req_ids:
                job = plan_prompt_logprobs(
                    state.req_id, state.token_ids, state.num_prompt_tokens, int(computed[i]), int(num_scheduled[i]),
                    int(query_start_loc[i]), state.params.prompt_logprobs or 0,
                )
                if job is not None:
                    jobs.append(job)
        return jobs

    def _write_positions_and_slots(self, host: dict[str, np.ndarray], rows: np.ndarray, num_scheduled: np.ndarray,
                                   computed: np.ndarray, query_start_loc: np.ndarray) -> None:
        """positions = computed .. computed + scheduled; slot = block_table[pos // bs] * bs + pos % bs."""
        num_reqs, num_tokens = len(rows), int(query_start_loc[-1])
        if num_tokens == num_reqs:  # one token each (a decode batch): token i is request i's, at its computed count
            positions, token_rows = computed, rows
        else:
            req_index = np.repeat(np.arange(num_reqs), num_scheduled)
            positions = computed[req_index] + np.arange(num_tokens) - query_start_loc[req_index]
            token_rows = rows[req_index]
        host["positions"][:num_tokens] = positions
        block_ids = self.block_table.table[token_rows, positions // self.block_size].astype(np.int64)
        host["slot_mapping"][:num_tokens] = block_ids * self.block_size + positions % self.block_size

    def _step_inputs(self, layout: StepLayout, req_ids: list[str], num_tokens: int, sample_indices: list[int],
                     sampling_metadata: SamplingMetadata, num_logits_rows: int) -> StepInputs:
        """The step's tensors: views of the layout's device sections (copied by `StepStaging.to_device`)."""
        num_reqs = len(req_ids)
        views, host = layout.views(num_tokens, num_reqs), layout.host
        rows = views["request_rows"]
        return StepInputs(
            req_ids=req_ids,
            input_ids=views["input_ids"],
            positions=views["positions"],
            attn_metadata=AttentionMetadata(
                slot_mapping=views["slot_mapping"],
                query_start_loc=views["query_start_loc"],
                seq_lens=views["seq_lens"],
                block_tables=self._gathered_block_tables(req_ids, rows),
                query_start_loc_cpu=host["query_start_loc"][: num_reqs + 1].tolist(),
                seq_lens_cpu=host["seq_lens"][:num_reqs].tolist(),
                block_size=self.block_size,
                request_rows=rows,
                request_rows_cpu=host["request_rows"][:num_reqs].tolist() if self.keeps_states else None,
            ),
            sample_indices=sample_indices,
            logits_indices=layout.device["logits_indices"][:num_logits_rows],  # none when every token samples
            sampling_metadata=sampling_metadata,
        )

    def _gathered_block_tables(self, req_ids: list[str], rows: torch.Tensor) -> torch.Tensor:
        """The step's block-table rows on the device, gathered again unless the last gather was of the same requests
        in the same order and the table has not been written since (decode steps between block boundaries: one
        launch a step less)."""
        version, last = self.block_table.version, self._gathered
        if last is None or last[0] != version or last[1] != req_ids:
            last = self._gathered = (version, req_ids, self.block_table.gather(rows, self.block_tables))
        return last[2]

    def _write_token_ids(self, input_ids: np.ndarray, states: list[RequestState], query_start_loc: np.ndarray,
                         computed: np.ndarray, seq_lens: np.ndarray) -> None:
        if len(states) == query_start_loc[-1]:  # one token each (a decode batch): token i is request i's
            input_ids[: len(states)] = [state.token_ids[c] for state, c in zip(states, computed.tolist())]
            return
        decodes = seq_lens - computed == 1
        if decodes.any():  # one token each (most rows of a busy step): gathered in one pass, written in one
            rows = decodes.nonzero()[0]
            input_ids[query_start_loc[rows]] = [states[i].token_ids[c] for i, c in zip(rows.tolist(),
                                                                                      computed[rows].tolist())]
        for i in (~decodes).nonzero()[0].tolist():  # prefill chunks
            input_ids[query_start_loc[i] : query_start_loc[i + 1]] = states[i].token_ids[computed[i] : seq_lens[i]]

    def _sampling_metadata(self, states: list[RequestState], positions: list[int],
                           rows: np.ndarray | None = None) -> SamplingMetadata:
        """``rows``: the states' rows when already gathered (every scheduled request samples once)."""
        device = self.device
        processors = build_logits_processors_metadata(states, device) if self._num_logits_params else None
        logprobs = (LogprobsMetadata.build([s.params.logprobs for s in states], device,
                                           [s.params.logprobs_mode for s in states]) if self._num_logprobs else None)
        if self._num_random:
            sampling = self._random_rows_metadata(states, positions, rows, processors, logprobs)
        else:  # every row greedy: no per-row settings to gather
            sampling = SamplingMetadata.greedy(len(states), processors, logprobs)
        if self.generation_rules is not None:
            sampling.generation_rules = self.generation_rules.step(states, positions)
        return sampling

    def _random_rows_metadata(self, states: list[RequestState], positions: list[int], rows: np.ndarray | None,
                              processors: LogitsProcessorsMetadata | None,
                              logprobs: LogprobsMetadata | None) -> SamplingMetadata:
        """Some request of the batch samples with a temperature: the rows' settings, its random rows' on the device."""
        if rows is None:
            rows = np.fromiter((s.row for s in states), np.int64, len(states))
        return SamplingMetadata.from_arrays(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.min_p[rows],
            seeds=[s.params.seed for s in states],
            positions=positions,
            device=self.device,
            logits_processors=processors,
            logprobs=logprobs,
        )

    # ------------------------------------------------------------ after the step
    def finish_step(self, inputs: StepInputs, sched_out: SchedulerOutput, sampled: list[int],
                    verified: dict[int, list[int]] | None = None) -> None:
        """Advance computed counts and append the sampled tokens to their rows (``verified``: a drafted
        request's tokens by sampling index, in place of its drafts)."""
        self._advance(sched_out)
        for i, token in zip(inputs.sample_indices, sampled):
            self.requests[inputs.req_ids[i]].token_ids.append(token)
        for request in inputs.drafted:
            assert verified is not None
            state, tokens = self.requests[inputs.req_ids[inputs.sample_indices[request.sample]]], verified[request.sample]
            del state.token_ids[-len(request.drafts) - 1 :]  # the drafts and the usual row's token
            state.token_ids += tokens
            state.num_computed_tokens -= len(request.drafts) + 1 - len(tokens)  # rejected drafts: not computed
        if self.prompt_logprobs_req_ids:
            self.prompt_logprobs_req_ids.difference_update(inputs.req_ids[i] for i in inputs.sample_indices)

    def defer_step(self, inputs: StepInputs, sched_out: SchedulerOutput, device_tokens: torch.Tensor) -> PendingTokens:
        """`finish_step` with the sampled ids still on the device: the rows get `PENDING_TOKEN` for now.

        The caller resolves the returned `PendingTokens` (after launching the next step, typically).
        """
        assert not self.prompt_logprobs_req_ids, "a step with prompt logprobs rows is finished, not deferred"
        self._advance(sched_out)
        requests, req_ids = self.requests, inputs.req_ids
        return self.feedback.defer(device_tokens, [requests[req_ids[i]].token_ids for i in inputs.sample_indices])

    def _advance(self, sched_out: SchedulerOutput) -> None:
        requests = self.requests
        for req_id, num in sched_out.num_scheduled_tokens.items():
            requests[req_id].num_computed_tokens += num


def _plan_state_checkpoints(metadata: AttentionMetadata, sched_out: SchedulerOutput,
                            requests: dict[str, RequestState]) -> None:
    """The core's checkpoint loads and saves for the state layers, by row (asyncllm/models/row_states.py)."""
    metadata.state_loads = [(requests[req_id].row, slot) for req_id, slot in sched_out.state_loads.items()]
    metadata.state_saves = [
        (requests[req_id].row, point - requests[req_id].num_computed_tokens, slot)
        for req_id, points in sched_out.state_saves.items() for point, slot in points
    ]
