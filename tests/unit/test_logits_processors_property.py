"""Drawn batches of requests through the sampler's logits processors, step after step, against a recount.

Hypothesis draws requests with any mix of allowed_token_ids, bad words, logit_bias, min_tokens (with stop ids and
EOS) and the three penalties, over a small vocabulary so that the bad words fire, the penalties hit and allowed sets
run out. Requests join (some as if resumed after a preemption, with outputs already) and leave between steps, take
and give back input-batch rows as `InputBatch` does (so the penalty tables' rows are reused, and grow past their first
size), and each step samples a drawn subset of them in a drawn order, greedily. Some carry drafts (speculative
decoding): their draft positions' rows follow the usual ones, as `InputBatch.prepare_inputs` lays them out, the drafts
are verified (`verify_drafts`) and the accepted ones counted as the model runner counts them.

Each step, every logits row's processed logits must equal a per-row reference that recounts the prompt and the
outputs up to that row's position (a draft position's: with the drafts before it) from scratch in vLLM's order:
allowed mask, bad words, logit_bias, min_tokens, repetition (transformers' processor), then frequency and presence.
That holds whatever else is in the batch. The exhausted rows (no allowed token left) must be exactly those the
reference finds, the requests the model runner fails exactly those that take a token from one, and the sampled token
the reference's argmax.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
from asyncllm.workers.logits_processors import RowLogitsParams, build_logits_processors_metadata
from asyncllm.workers.sampler import Sampler, SamplingMetadata
from asyncllm.workers.spec_decode import (
    DraftedRequest,
    DraftPosition,
    exhausted_after_drafts,
    exhausted_requests,
    verify_drafts,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from asyncllm.sampling import SamplingParams

CPU = torch.device("cpu")
VOCAB = 16
EOS = (0,)
ids = st.integers(0, VOCAB - 1)
hot = st.one_of(st.integers(0, 3), ids)
"""Ids that often land on the same few tokens (EOS among them), so that bad words and min_tokens forbid every allowed
token now and then."""


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    kwargs: dict = {"temperature": 0.0, "max_tokens": None}
    if draw(st.booleans()):
        kwargs["allowed_token_ids"] = draw(st.lists(hot, min_size=1, max_size=4))
    kwargs["bad_words_token_ids"] = draw(st.lists(st.lists(hot, min_size=1, max_size=3), max_size=3))
    if kwargs.get("allowed_token_ids") and draw(st.booleans()):  # a trap: after this token no allowed one is left
        trap = draw(st.sampled_from(kwargs["allowed_token_ids"]))
        kwargs["bad_words_token_ids"] += [[trap, token] for token in kwargs["allowed_token_ids"]]
    if draw(st.booleans()):
        kwargs["logit_bias"] = draw(st.dictionaries(ids, st.sampled_from([-100.0, -2.5, 0.5, 3.0, 100.0]),
                                                    max_size=4))
    kwargs["min_tokens"] = draw(st.integers(0, 4))
    kwargs["stop_token_ids"] = draw(st.lists(hot, max_size=2))
    kwargs["repetition_penalty"] = draw(st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0]))
    kwargs["presence_penalty"] = draw(st.sampled_from([0.0, 0.0, 0.5, -0.5, 1.5]))
    kwargs["frequency_penalty"] = draw(st.sampled_from([0.0, 0.0, 0.3, -0.3, 1.0]))
    return SamplingParams(**kwargs)


@dataclass
class Request:
    """A worker request row, as `workers/input_types.RequestState` reads to the processors."""

    params: SamplingParams
    row: int
    token_ids: list[int]
    num_prompt_tokens: int
    logits_params: RowLogitsParams | None = field(init=False)
    drafts: list[int] = field(default_factory=list)
    """This step's drafts, at the end of ``token_ids`` while it runs."""

    def __post_init__(self) -> None:
        self.logits_params = RowLogitsParams.from_params(self.params, EOS)


def reference(logits: torch.Tensor, request: Request, end: int) -> tuple[torch.Tensor, bool]:
    """(the row's processed logits, whether no allowed token is left), recounted from the request's first ``end``
    tokens."""
    p, out, x = request.params, request.token_ids[request.num_prompt_tokens:end], logits.clone()
    inf = float("-inf")
    if p.allowed_token_ids:
        keep = torch.full_like(x, inf)
        keep[p.allowed_token_ids] = x[p.allowed_token_ids]
        x = keep
    banned = {w[-1] for w in p.bad_words_token_ids if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]}
    for token in banned:
        x[token] = inf
    for token, bias in (p.logit_bias or {}).items():
        x[token] += torch.tensor(bias, dtype=torch.float32)
    stops = set(p.stop_token_ids) | set(EOS)
    holds = len(out) < p.min_tokens
    if holds:
        x[sorted(stops)] = inf
    x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([request.token_ids[:end]]), x[None])[0]
    counts = np.bincount(out, minlength=VOCAB)
    for token in set(out):
        x[token] = x[token] - torch.tensor(p.frequency_penalty, dtype=torch.float32) * int(counts[token])
        x[token] = x[token] - torch.tensor(p.presence_penalty, dtype=torch.float32)
    forbidden = banned | (stops if holds else set())
    exhausted = bool(p.allowed_token_ids) and set(p.allowed_token_ids) <= forbidden
    return x, exhausted


Step = tuple[list[tuple[SamplingParams, list[int], list[int]]], int, int]


@st.composite
def scenario(draw: st.DrawFn) -> list[Step]:
    """Steps of (requests joining: params, prompt, outputs so far; how many active ones leave; a seed that picks
    those and the step's sampling rows, in order, among the requests then active)."""
    joining = st.tuples(sampling_params(), st.lists(ids, min_size=1, max_size=6), st.lists(ids, max_size=4))
    return draw(st.lists(st.tuples(st.lists(joining, max_size=4), st.integers(0, 2), st.integers(0, 2**16)),
                         min_size=1, max_size=10))


@settings(max_examples=150, deadline=None)
@given(scenario(), st.integers(0, 2**31 - 1))
def test_drawn_batches_match_a_per_row_recount_step_after_step(steps, seed: int) -> None:
    sampler = Sampler(0, CPU)
    free_rows = list(range(5, -1, -1))  # InputBatch's: lowest first, a freed row reused next; grows when none is left
    active: list[Request] = []
    generator = torch.Generator().manual_seed(seed)
    for joins, num_leaving, step_seed in steps:
        for params, prompt, outputs in joins:
            if not free_rows:
                free_rows = [max(r.row for r in active) + 1]
            active.append(Request(params, free_rows.pop(), prompt + outputs, len(prompt)))
        rng = random.Random(step_seed)
        for request in rng.sample(active, min(num_leaving, len(active) // 2)):
            active.remove(request)
            free_rows.append(request.row)
        if not active:
            continue
        batch = rng.sample(active, rng.randint(1, len(active)))  # some rows sample nothing (a prefill chunk)
        for request in [r for r in batch if rng.random() < 0.4]:
            likely = request.params.allowed_token_ids or range(VOCAB)  # a drafter proposes tokens it has seen
            request.drafts = [rng.choice(likely) for _ in range(rng.randint(1, 3))]
            request.token_ids += request.drafts  # as `prepare_inputs` adds them for the step
        states, rows = logits_rows(batch)
        logits = torch.randn(len(rows), VOCAB, generator=generator) * 3
        for i, (request, end) in enumerate(rows):  # most drafts are what the model would sample there
            draft_index = end - (len(request.token_ids) - len(request.drafts))
            if draft_index < len(request.drafts) and rng.random() < 0.7:
                logits[i, request.drafts[draft_index]] += 30
        expected = [reference(logits[i], request, end) for i, (request, end) in enumerate(rows)]
        processors = build_logits_processors_metadata(states, CPU)
        tokens = sampler(logits, SamplingMetadata.greedy(len(rows), processors)).sampled_token_ids.tolist()
        exhausted = {i for i, (_, none_left) in enumerate(expected) if none_left}
        assert set(processors.exhausted if processors is not None else ()) == exhausted
        for i, (want, _) in enumerate(expected):
            torch.testing.assert_close(logits[i], want, rtol=0, atol=1e-5)
            assert i in exhausted or want[tokens[i]] == want.max(), (i, tokens[i], want)
        for request in finish_step(sampler, batch, tokens, exhausted):  # their requests fail: rows freed
            active.remove(request)
            free_rows.append(request.row)


def logits_rows(batch: list[Request]) -> tuple[list, list[tuple[Request, int]]]:
    """The sampler's row states and (request, tokens before the row's position) of each logits row: the usual rows
    in batch order, then each drafted request's draft positions (`InputBatch.prepare_inputs`)."""
    states: list = list(batch)
    rows = [(request, len(request.token_ids)) for request in batch]
    for at, request in enumerate(batch):
        k = len(request.drafts)
        if not k:
            continue
        if request.logits_params is None:
            states += [request] * k
        else:
            states[at] = DraftPosition.of(request, k, k)
            states += [DraftPosition.of(request, k, j) for j in range(k)]
        rows += [(request, len(request.token_ids) - k + j) for j in range(k)]
    return states, rows


def finish_step(sampler: Sampler, batch: list[Request], tokens: list[int], exhausted: set[int]) -> list[Request]:
    """Append each request's tokens (a drafted one's verified tokens in place of its drafts, counted in the penalty
    tables as the model runner counts them); return the requests that sampled from an exhausted row, checking that
    the model runner fails the same ones (`exhausted_requests`, `exhausted_after_drafts`)."""
    drafted, used, first_row = [], {}, len(batch)
    for at, request in enumerate(batch):
        k = len(request.drafts)
        if k:
            drafted.append(DraftedRequest(at, first_row, request.drafts))
        used[at] = [first_row + j for j in range(k)] + [at]  # its rows in position order
        first_row += k
    verified = verify_drafts(tokens, drafted)
    verified.update((at, [tokens[at]]) for at, request in enumerate(batch) if not request.drafts)
    failed = [at for at in range(len(batch)) if exhausted & set(used[at][: len(verified[at])])]
    req_ids = [str(at) for at in range(len(batch))]
    at_once, after_drafts = exhausted_requests(req_ids, list(range(len(batch))), drafted, tuple(sorted(exhausted)))
    assert {int(i) for i in at_once} | set(exhausted_after_drafts(verified, after_drafts)) == set(failed)
    for at, request in enumerate(batch):
        del request.token_ids[len(request.token_ids) - len(request.drafts):]
        request.token_ids += verified[at]
        if request.drafts and request.logits_params is not None and request.logits_params.penalized:
            sampler.penalty_tables.record_tokens(request.row, verified[at])
        request.drafts = []
    return [batch[at] for at in failed]
