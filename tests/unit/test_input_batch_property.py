"""`InputBatch` (workers/input_batch.py) against a model of the scheduler's requests, under drawn steps (hypothesis).

A model core admits requests (fresh, or resumed after preemption, some on a
prefix-cache hit), schedules prefill chunks and decodes in drawn orders, hands
out shuffled block ids, finishes and preempts, and samples drawn token ids. The
batch applies each step's diffs and flattens it; every step's inputs must be
what the model's requests say: input ids (deferred ones included: a step's ids
left on the device feed the next step's inputs, `TokenFeedback`), positions,
KV slots, query starts, sequence lengths, block-table rows (gathered again only
when needed; the device mirror updated by diffs, also on the CPU), the sampling
rows and their settings, each prompt position's prompt-logprobs target (for the
requests that ask, until they sample), and a decode batch's padding to its CUDA
graph's size. With drafting on (speculative decoding: never deferred, as a drafter's runner
does), decoding requests carry drawn drafts, some accepted: the draft positions'
logits rows and settings follow the usual ones, and the verified tokens replace
the drafts. A request keeps its row while the batch knows it; rows are reused and
grow past ``max_num_reqs``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.workers.block_table import BlockTable
from asyncllm.workers.input_batch import InputBatch
from asyncllm.workers.input_types import StepInputs
from asyncllm.workers.sampler import SamplingMetadata
from asyncllm.workers.spec_decode import verify_drafts
from asyncllm.workers.token_feedback import PendingTokens

CPU = torch.device("cpu")
MAX_REQS = 4
"""Requests a step schedules at most; the batch knows up to two more (their rows grow past it)."""
MAX_TOKENS = 12
MAX_LEN = 20


@dataclass
class Req:
    """The core's view of one request."""

    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    prompt_logprobs: bool = False
    """Sent with its prompt alone and asking for prompt logprobs: each step reports those of its chunk, until it
    samples."""


@dataclass
class Core:
    """The model scheduler: requests the batch knows, requests waiting to be sent, and the free blocks."""

    block_size: int
    free: list[int]
    known: dict[str, Req] = field(default_factory=dict)
    waiting: dict[str, Req] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    """Known requests at their last token: the next step finishes them."""
    next_id: int = 0
    drafting: bool = False
    """Decoding requests may carry drafts (speculative decoding)."""

    def release(self, req: Req) -> None:
        self.free += req.blocks
        req.blocks, req.computed = [], 0

    def allocate(self, req: Req, num_tokens: int) -> list[int]:
        """Blocks for the first ``num_tokens`` tokens: the new ones."""
        need = max(0, -(-num_tokens // self.block_size) - len(req.blocks))  # rejected drafts leave blocks spare
        new, self.free = self.free[:need], self.free[need:]
        assert len(new) == need, "the model's pool is sized never to run out"
        req.blocks += new
        return new


def _params(data: st.DataObject) -> SamplingParams:
    prompt_logprobs = data.draw(st.sampled_from([None, None, None, 0, 2]))
    if data.draw(st.booleans()):
        return SamplingParams(temperature=0.0, prompt_logprobs=prompt_logprobs)
    return SamplingParams(temperature=data.draw(st.sampled_from([0.5, 1.0])), top_k=data.draw(st.sampled_from([0, 3])),
                          top_p=data.draw(st.sampled_from([1.0, 0.9])), min_p=data.draw(st.sampled_from([0.0, 0.1])),
                          seed=data.draw(st.none() | st.integers(0, 9)), prompt_logprobs=prompt_logprobs)


def _schedule(data: st.DataObject, core: Core, lockstep: bool) -> tuple[SchedulerOutput, dict[str, int]]:
    """One step's diffs; also the hit lengths of the step's new requests, to check that they were kept.

    A known request finishes, is preempted or is left out of the step at 1 in ``odds``. In ``lockstep`` traffic,
    churn is rare, and one-token prompts arrive together only while fewer than two requests are known: the same
    requests, of the same lengths, mostly decode on together (in kept, reversed or drawn orders).
    """
    odds = 30 if lockstep else 6
    finished, preempted, admitted = _drop(data, core, odds)
    admitted += _arrive(data, core, lockstep)
    scheduled: dict[str, int] = {}
    new_reqs, hits = _admit(data, core, admitted, scheduled)
    cached, spec = _continue(data, core, odds, scheduled)
    how = data.draw(st.sampled_from(["kept", "reversed", "drawn"]))
    order = {"kept": list(scheduled), "reversed": list(scheduled)[::-1]}.get(how) or data.draw(
        st.permutations(list(scheduled)))
    num_scheduled = {rid: scheduled[rid] for rid in order}
    out = SchedulerOutput(0, new_reqs, cached, num_scheduled, sum(num_scheduled.values()),
                          finished_req_ids=finished, preempted_req_ids=preempted, spec_token_ids=spec)
    return out, hits


def _drop(data: st.DataObject, core: Core, odds: int) -> tuple[list[str], list[str], list[str]]:
    """Finished (and aborted waiting) requests, preempted ones, and the waiting ones to admit (not those)."""
    finished = [rid for rid in core.known if rid in core.done or data.draw(st.integers(1, odds)) == 1]
    finished += [rid for rid in core.waiting if data.draw(st.integers(0, 9)) == 0]  # aborted before being sent
    for rid in finished:
        core.release(core.known.pop(rid, None) or core.waiting.pop(rid))
        core.done.discard(rid)
    preempted = [rid for rid in core.known if data.draw(st.integers(1, odds)) == 1]
    admitted = [rid for rid in core.waiting if data.draw(st.booleans())]
    for rid in preempted:  # recompute preemption: blocks freed, the request re-sent in full later
        req = core.waiting[rid] = core.known.pop(rid)
        core.release(req)
    return finished, preempted, admitted


def _arrive(data: st.DataObject, core: Core, lockstep: bool) -> list[str]:
    """New requests, waiting: a step's arrivals have prompts of one length."""
    size = 1 if lockstep else data.draw(st.sampled_from([1, 2, 3]) | st.integers(1, MAX_LEN - 2))
    arrivals = [1, 2] if not core.known and not core.waiting else [0, 0, 0, 1, 2]
    new = []
    for _ in range(0 if lockstep and len(core.known) >= 2 else data.draw(st.sampled_from(arrivals))):
        rid, core.next_id = f"r{core.next_id}", core.next_id + 1
        prompt = data.draw(st.lists(st.integers(0, 999), min_size=size, max_size=size))
        core.waiting[rid] = Req(prompt, len(prompt), _params(data))
        new.append(rid)
    return new


def _room(scheduled: dict[str, int]) -> int:
    """Tokens the step may still schedule (0 once it holds `MAX_REQS` requests)."""
    return 0 if len(scheduled) == MAX_REQS else MAX_TOKENS - sum(scheduled.values())


def _admit(data: st.DataObject, core: Core, admitted: list[str],
           scheduled: dict[str, int]) -> tuple[list[NewRequestData], dict[str, int]]:
    """Send waiting requests in full, each on a drawn prefix-cache hit of whole blocks, with a first chunk."""
    new_reqs, hits = [], {}
    for rid in admitted:
        req, room = core.waiting[rid], _room(scheduled)
        if len(core.known) >= MAX_REQS + 2 or room == 0:
            break
        hits_allowed = req.params.prompt_logprobs is None  # such a request reads no prefix-cache block (vLLM's)
        hit = core.block_size * data.draw(st.integers(0, (len(req.tokens) - 1) // core.block_size * hits_allowed))
        req.prompt_logprobs = not hits_allowed and len(req.tokens) == req.num_prompt
        n = data.draw(st.integers(1, min(room, len(req.tokens) - hit)))
        core.allocate(req, hit + n)
        req.computed = hits[rid] = hit
        core.known[rid] = core.waiting.pop(rid)
        new_reqs.append(NewRequestData(rid, list(req.tokens), req.num_prompt, req.params, list(req.blocks), hit))
        scheduled[rid] = n
    return new_reqs, hits


def _continue(data: st.DataObject, core: Core, odds: int,
              scheduled: dict[str, int]) -> tuple[CachedRequestData, dict[str, list[int]]]:
    """Schedule known requests (a prefill chunk, or their decode token and any drafts) as diffs: counts and new
    blocks; and the drafts."""
    cached, spec = CachedRequestData(), {}
    for rid, req in core.known.items():
        room = _room(scheduled)
        if rid in scheduled or rid in core.done or room == 0:
            continue
        if data.draw(st.integers(1, odds)) == 1:
            continue  # left out of this step
        n = data.draw(st.integers(1, min(room, len(req.tokens) - req.computed)))
        most = min(3, room - 1, MAX_LEN - len(req.tokens) - 1)  # the verified tokens stay within MAX_LEN
        if core.drafting and n == len(req.tokens) - req.computed == 1 and most > 0 and data.draw(st.booleans()):
            spec[rid] = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=most))
            n += len(spec[rid])
        new = core.allocate(req, req.computed + n)
        cached.req_ids.append(rid)
        cached.num_computed_tokens.append(req.computed)
        if new:
            cached.new_block_ids[rid] = new
        scheduled[rid] = n
    return cached, spec


def _check_inputs(batch: InputBatch, core: Core, out: SchedulerOutput,
                  graph_sizes: list[int]) -> tuple[StepInputs, list[int]]:
    """The step's flattened inputs against the model's requests; the step, and the indices of those that sample."""
    step = batch.prepare_inputs(out)
    order = list(out.num_scheduled_tokens)
    reqs = [core.known[rid] for rid in order]
    known = [req.tokens + out.spec_token_ids.get(rid, []) for rid, req in zip(order, reqs)]  # drafts as inputs
    counts = [out.num_scheduled_tokens[rid] for rid in order]
    bs = core.block_size
    ids, positions, slots, starts = [], [], [], [0]
    for req, tokens, n in zip(reqs, known, counts):
        span = range(req.computed, req.computed + n)
        ids += tokens[span.start : span.stop]
        positions += span
        slots += [req.blocks[p // bs] * bs + p % bs for p in span]
        starts.append(starts[-1] + n)
    meta = step.attn_metadata
    assert step.req_ids == order
    assert step.input_ids.tolist() == ids, "input ids (a deferred step's ids too)"
    assert step.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == starts
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [req.computed + n for req, n in zip(reqs, counts)]
    assert meta.request_rows.tolist() == [batch.requests[rid].row for rid in order]
    width = batch.block_table.max_blocks_per_req
    assert meta.block_tables.tolist() == [req.blocks + [0] * (width - len(req.blocks)) for req in reqs]
    sample = [i for i, (req, tokens, n) in enumerate(zip(reqs, known, counts)) if req.computed + n == len(tokens)]
    assert step.sample_indices == sample
    _check_logits_rows(step, out, sample, starts)
    decode = len(ids) == len(order)
    fits = [size for size in graph_sizes if size >= len(order)]
    expected_size = min(fits) if decode and fits else None  # the smallest capture size that holds the batch
    assert step.graph_size == expected_size
    if expected_size is not None:
        _check_padding(batch, len(order), expected_size)
    rows = [(reqs[i], len(known[i])) for i in sample]  # each sampling row: its request, the index of its token
    for i in sample:  # then each draft position's row
        rows += [(reqs[i], len(reqs[i].tokens) + j) for j in range(len(out.spec_token_ids.get(order[i], [])))]
    _check_sampling(step.sampling_metadata, rows)
    _check_prompt_logprobs(step, reqs, counts, starts)
    return step, sample


def _check_prompt_logprobs(step: StepInputs, reqs: list[Req], counts: list[int], starts: list[int]) -> None:
    """Each position a prompt-logprobs request computes before its prompt's last gives the next prompt token's
    logprobs: (request, flat index, prompt index, target, logprobs asked), position by position."""
    expected = []
    for rid, req, n, start in zip(step.req_ids, reqs, counts, starts):
        if req.prompt_logprobs:
            expected += [(rid, start + p - req.computed, p + 1, req.tokens[p + 1], req.params.prompt_logprobs)
                         for p in range(req.computed, req.computed + n) if p + 1 < req.num_prompt]
    got = [(job.req_id, job.flat_start + k, job.start + k, target, job.num_logprobs)
           for job in step.prompt_logprobs_jobs for k, target in enumerate(job.target_token_ids)]
    assert got == expected


def _check_logits_rows(step: StepInputs, out: SchedulerOutput, sample: list[int], starts: list[int]) -> None:
    """The sampling requests' last tokens, then each drafted one's draft positions (the tokens before its last)."""
    order = step.req_ids
    drafted = [(s, i, out.spec_token_ids[order[i]]) for s, i in enumerate(sample) if order[i] in out.spec_token_ids]
    assert step.every_token_samples == (len(sample) == len(step.input_ids) and not drafted)
    logits_rows = [] if step.every_token_samples else [starts[i + 1] - 1 for i in sample]
    first_rows = []
    for _, i, drafts in drafted:
        first_rows.append(len(logits_rows))
        logits_rows += range(starts[i + 1] - 1 - len(drafts), starts[i + 1] - 1)
    assert step.logits_indices.tolist() == logits_rows
    assert [(d.sample, d.first_row, d.drafts) for d in step.drafted] == [
        (s, first, drafts) for (s, _, drafts), first in zip(drafted, first_rows)]


def _check_padding(batch: InputBatch, num_reqs: int, size: int) -> None:
    host = batch.layout.host
    assert batch.layout.num_reqs == size and batch.layout.num_tokens == size
    assert host["slot_mapping"][num_reqs:].tolist() == [-1] * (size - num_reqs), "padding writes no KV"
    assert host["seq_lens"][num_reqs:].tolist() == [0] * (size - num_reqs)
    assert host["query_start_loc"][num_reqs:].tolist() == [num_reqs] * (size - num_reqs + 1), "empty queries"


def _check_sampling(meta: SamplingMetadata, rows: list[tuple[Req, int]]) -> None:
    """The logits rows' settings: the random rows' temperature, filters, seeds and token indices."""
    assert meta.num_rows == len(rows)
    hot = [i for i, (req, _) in enumerate(rows) if req.params.temperature > 0]
    if not hot:
        assert meta.random_rows is None
        return
    assert meta.random_rows.tolist() == hot and meta.all_random == (len(hot) == len(rows))
    assert meta.temperature.tolist() == [rows[i][0].params.temperature for i in hot]
    assert meta.seeds == [rows[i][0].params.seed for i in hot]
    assert meta.positions == [rows[i][1] for i in hot], "the index of the token each row samples"
    for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
        values = [getattr(rows[i][0].params, name) for i in hot]
        tensor = getattr(meta, name)
        if tensor is None:
            assert values == [off] * len(hot), name
        else:
            assert np.allclose(tensor.tolist(), values), name


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4]), mirror=st.booleans(),
       graphs=st.sampled_from([[], [1, 2, 4], [2, 3]]), seed=st.integers(0, 2**16), lockstep=st.booleans(),
       drafting=st.booleans())
def test_each_step_s_inputs_are_the_model_s(data: st.DataObject, block_size: int, mirror: bool, graphs: list[int],
                                           seed: int, lockstep: bool, drafting: bool) -> None:
    max_blocks = -(-MAX_LEN // block_size)
    free = list(range(1, (MAX_REQS + 3) * max_blocks + 1))
    random.Random(seed).shuffle(free)  # scattered ids catch slot and table mistakes; 0 stays unused
    core = Core(block_size, free, drafting=drafting)
    BlockTable.MIRROR_ON_CPU = mirror  # the device table updated by diffs, as on a GPU
    try:
        batch = InputBatch(MAX_REQS, MAX_TOKENS, MAX_LEN, block_size, CPU)
    finally:
        BlockTable.MIRROR_ON_CPU = False
    batch.graph_sizes = graphs
    rows: dict[str, int] = {}
    last: PendingTokens | None = None
    for _ in range(data.draw(st.integers(1, 20))):
        out, hits = _schedule(data, core, lockstep)
        batch.update_states(out)
        _check_rows(batch, core, out, hits, rows)
        if last is not None and (batch.prompt_logprobs_req_ids or data.draw(st.booleans())):
            batch.feedback.resolve(last)  # as a step that reads output tokens on the host does first
        pending = _run(data, batch, core, out, graphs) if out.num_scheduled_tokens else None
        if last is not None:
            batch.feedback.resolve(last)  # the step before's ids reach the host after this step's launch
        last = pending
    if last is not None:
        batch.feedback.resolve(last)
    for rid, req in core.known.items():
        state = batch.requests[rid]
        assert state.token_ids == req.tokens and state.num_computed_tokens == req.computed, rid
        assert batch.block_table.table[state.row, : len(req.blocks)].tolist() == req.blocks


def _check_rows(batch: InputBatch, core: Core, out: SchedulerOutput, hits: dict[str, int],
                rows: dict[str, int]) -> None:
    """After the diffs: the batch knows the core's requests, resumed ones at their hits, each in a row of its own
    that it keeps while known (``rows``: the rows seen so far)."""
    assert set(batch.requests) == set(core.known)
    assert batch.prompt_logprobs_req_ids == {rid for rid, req in core.known.items() if req.prompt_logprobs}
    for new in out.new_reqs:
        assert batch.requests[new.req_id].num_computed_tokens == hits[new.req_id]
    for rid in [*out.finished_req_ids, *out.preempted_req_ids]:
        rows.pop(rid, None)
    for rid, state in batch.requests.items():
        assert rows.setdefault(rid, state.row) == state.row, "a known request keeps its row"
    assert len(set(rows.values())) == len(rows)


def _run(data: st.DataObject, batch: InputBatch, core: Core, out: SchedulerOutput,
         graphs: list[int]) -> PendingTokens | None:
    """Prepare and check the step, sample drawn ids, and finish it, or defer it (its ids left on the device)."""
    inputs, sample = _check_inputs(batch, core, out, graphs)
    order = list(out.num_scheduled_tokens)
    sampled = data.draw(st.lists(st.integers(0, 999), min_size=len(sample), max_size=len(sample), unique=True))
    extra, outputs = [], {}
    for s, i in enumerate(sample):  # a drafted request's draft positions sample each draft, or another id
        drafts = out.spec_token_ids.get(order[i], [])
        ids = [draft if data.draw(st.booleans()) else 4 + data.draw(st.integers(0, 5)) for draft in drafts]
        extra += ids
        rejected = next((j for j, (draft, got) in enumerate(zip(drafts, ids)) if draft != got), None)
        outputs[i] = [*drafts, sampled[s]] if rejected is None else ids[: rejected + 1]  # accepted drafts, one more
    verified = verify_drafts(sampled + extra, inputs.drafted)
    assert verified == {s: outputs[i] for s, i in enumerate(sample) if order[i] in out.spec_token_ids}
    for rid in order:
        core.known[rid].computed += out.num_scheduled_tokens[rid] - len(out.spec_token_ids.get(rid, []))
    collecting = any(req.prompt_logprobs for req in core.known.values())  # such steps are finished, not deferred
    for i in sample:
        req = core.known[order[i]]
        req.prompt_logprobs = False
        req.tokens += outputs[i]
        req.computed += len(outputs[i]) - 1  # the accepted drafts' KV
        if len(req.tokens) >= MAX_LEN:
            core.done.add(order[i])
    if sample and not core.drafting and not collecting and data.draw(st.booleans()):  # the next step takes them
        return batch.defer_step(inputs, out, torch.tensor(sampled, dtype=torch.int64))
    batch.finish_step(inputs, out, sampled, verified)
    return None
