"""Drawn batches through the worker's `Sampler` and its logprobs, against a naive per-row reference (hypothesis).

Hypothesis draws 1 to 6 rows over a vocabulary of 5 to 40 tokens. Logits come from a quarter-step grid with -inf
entries, so ties are common (at the maximum, at top-k's k-th value, at top-p's boundary) and distinct logits stay
distinct after the temperature. Each row is greedy (temperature 0, or below `GREEDY_EPS`) or random with a drawn
temperature, min_p, top_k and top_p, seeded or not, at a drawn position, and asks for 0 to 5 logprobs, the whole
vocabulary (-1) or none.

The reference filters each random row as docs/sampling.md ("How the logits become a token") and the module's
docstring say, in float64: divide by the temperature, drop tokens whose probability is below min_p times the top one,
keep every token at least as large as the k-th largest logit left (ties at the k-th value all kept), then keep the
smallest set of most likely tokens left whose renormalised probability reaches top_p. Ties at top-p's boundary value
make that set's members ambiguous but not its size: the reference fixes the tokens above the boundary value and the
count. A row whose min-p or top-p decision lies within float32 rounding of its threshold is not judged there.

Checked, for every drawn batch:
- the survivors: asking every row for the whole vocabulary as ``processed_logits`` must return -inf exactly outside
  the reference's survivors, and the logits divided by the temperature inside (greedy rows: the logits as given);
- greedy rows take the first maximal logit; a seeded random row takes ``argmax(probs / q)`` with ``q`` the Exp(1)
  noise of a generator seeded with ``mix_seed(seed, position)`` (the docstring's exponential race); every sampled
  token is a survivor, also over 16 further seeds per random row;
- reproducibility: a seeded row's token is the same alone in a batch, in the batch reversed, under another worker
  seed, and on a rerun; asking for logprobs changes no token;
- logprobs (the default raw mode): the row's own token with ``log_softmax`` of the raw logits and its rank (the
  number of tokens at least as likely), then the N most likely tokens, most likely first. Tokens tied inside the
  top-N come in torch's ``topk`` order, not by id (a greedy token tied with another may be listed second or left
  out), so only which values are listed is checked there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import msgspec
import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.protocol import LogprobsArrays
from asyncllm.sampling import SamplingParams
from asyncllm.workers.sampler import GREEDY_EPS, Sampler, SamplingMetadata, mix_seed

CPU = torch.device("cpu")
NEG_INF = float("-inf")
CLOSE_CALL = 1e-4
"""Relative distance from a min-p or top-p threshold within which float32 rounding may decide (the row is not
judged there)."""
EXTRA_SEEDS = 16
LOGIT_VALUES = [0.0, NEG_INF, 1.0, NEG_INF, 2.0, *(k / 4 for k in range(-12, 13))]
"""A quarter-step grid, -inf and a few values repeated for ties (a row with no finite logit gets a 0.0)."""


@dataclass(frozen=True)
class Row:
    """One logits row, its request's settings and the position of the token it samples."""

    logits: tuple[float, ...]
    params: SamplingParams
    position: int

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS


# ------------------------------------------------------------------ strategies
def logit_values(vocab: int) -> st.SearchStrategy[list[float]]:
    """A row of grid logits; a few hot values and -inf make ties and dead tokens common."""
    row = st.lists(st.sampled_from(LOGIT_VALUES), min_size=vocab, max_size=vocab)
    return row.map(lambda values: values if max(values) > NEG_INF else [0.0, *values[1:]])


@st.composite
def sampling_params(draw: st.DrawFn, vocab: int) -> SamplingParams:
    logprobs = draw(st.one_of(st.none(), st.integers(0, 5), st.just(-1)))
    if draw(st.integers(0, 3)) == 0:
        return SamplingParams(temperature=draw(st.sampled_from([0.0, GREEDY_EPS / 10])), logprobs=logprobs)
    return SamplingParams(
        temperature=draw(st.one_of(st.sampled_from([1.0, 0.5]), st.floats(0.05, 2.0))),
        min_p=draw(st.one_of(st.just(0.0), st.sampled_from([0.1, 0.5, 1.0]), st.floats(0.01, 1.0))),
        top_k=draw(st.one_of(st.sampled_from([0, -1]), st.integers(1, vocab + 2))),
        top_p=draw(st.one_of(st.sampled_from([1.0, 0.5, 1e-9]), st.floats(0.05, 0.99))),
        seed=draw(st.one_of(st.none(), st.integers(0, 5), st.integers(-(2**63), 2**63 - 1))),
        logprobs=logprobs,
    )


@st.composite
def batches(draw: st.DrawFn) -> list[Row]:
    vocab = draw(st.integers(5, 40))
    num_rows = draw(st.integers(1, 6))
    return [Row(tuple(draw(logit_values(vocab))), draw(sampling_params(vocab)), draw(st.integers(0, 5000)))
            for _ in range(num_rows)]


# ------------------------------------------------------------------ the reference
@dataclass
class Survivors:
    """A random row's survivors: ``sure`` always; plus ``tied_count`` of the ``tied`` tokens (top-p's boundary)."""

    sure: set[int]
    tied: set[int]
    tied_count: int

    def admits(self, kept: set[int]) -> bool:
        return self.sure <= kept and kept - self.sure <= self.tied and len(kept - self.sure) == self.tied_count


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def scaled_logits(row: Row) -> np.ndarray:
    """The logits over the temperature as float32 computes them (distinct grid values stay distinct)."""
    logits = np.array(row.logits, np.float32)
    return (logits / np.float32(row.params.temperature)).astype(np.float64)


def close_call(values: np.ndarray, threshold: float) -> bool:
    return bool(np.any(np.abs(values - threshold) <= CLOSE_CALL * max(threshold, 1e-30)))


def reference_survivors(row: Row) -> Survivors | None:
    """Temperature, min-p, top-k, top-p in vLLM's order, per token; None when rounding may decide."""
    params, x = row.params, scaled_logits(row)
    if params.min_p > 0:
        probs = softmax(x)
        threshold = params.min_p * probs.max()
        if close_call(probs[(probs > 0) & (x < x.max())], threshold):  # the top tokens always stay
            return None
        x = np.where(probs >= threshold, x, NEG_INF)
    if 0 < params.top_k < len(x):
        kth_largest = np.sort(x)[::-1][params.top_k - 1]
        x = np.where(x >= kth_largest, x, NEG_INF)
    alive = {int(t) for t in np.flatnonzero(np.isfinite(x))}
    if params.top_p >= 1.0:
        return Survivors(alive, set(), 0)
    return top_p_survivors(x, alive, params.top_p)


def exact_in_float32(probs: np.ndarray, top_p: float) -> bool:
    """Probabilities that are powers of two (two equal tokens: 0.5 each) and a top_p float32 holds sum exactly there,
    so a mass equal to top_p is decided as the reference decides it (1/3 of three tokens is not)."""
    return bool(np.float32(top_p) == top_p and all(math.log2(p).is_integer() for p in probs))


def top_p_survivors(x: np.ndarray, alive: set[int], top_p: float) -> Survivors | None:
    """The smallest set of most likely tokens whose renormalised probability reaches top_p."""
    probs = softmax(x)
    order = sorted(alive, key=lambda t: -x[t])
    mass = np.cumsum([probs[t] for t in order])
    if close_call(mass[mass != top_p] if exact_in_float32(probs[order], top_p) else mass, top_p):
        return None
    count = int(np.searchsorted(mass, top_p)) + 1  # the first prefix whose mass reaches top_p
    boundary = x[order[count - 1]]
    above = {t for t in alive if x[t] > boundary}
    tied = {t for t in alive if x[t] == boundary}
    if len(tied) == count - len(above):
        return Survivors(above | tied, set(), 0)
    return Survivors(above, tied, count - len(above))


def race_winners(row: Row, survivors: Survivors) -> set[int]:
    """The tokens ``argmax(probs / q)`` may pick for a seeded row, q from the (seed, position) generator.

    For survivors without an undecided tie; within CLOSE_CALL of the best ratio counts as a winner (float32 probs)."""
    x = scaled_logits(row)
    kept = np.array([t in survivors.sure for t in range(len(x))])
    probs = softmax(np.where(kept, x, NEG_INF))
    generator = torch.Generator().manual_seed(mix_seed(row.params.seed, row.position))
    noise = torch.empty(len(x)).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    ratio = probs / noise.double().numpy()
    return {int(t) for t in np.flatnonzero(ratio >= ratio.max() * (1 - CLOSE_CALL))}


# ------------------------------------------------------------------ running the sampler
def run(rows: list[Row], worker_seed: int = 0) -> tuple[list[int], list[LogprobsArrays] | None]:
    metadata = SamplingMetadata.from_params([r.params for r in rows], [r.position for r in rows], CPU)
    logits = torch.tensor([r.logits for r in rows], dtype=torch.float32)
    out = Sampler(worker_seed, CPU)(logits, metadata)
    return out.sampled_token_ids.tolist(), out.logprobs


def unpack(arrays: LogprobsArrays) -> tuple[list[int], np.ndarray, int]:
    ids = np.frombuffer(arrays.token_ids, "<i4").reshape(-1, arrays.width)
    values = np.frombuffer(arrays.logprobs, "<f4").reshape(-1, arrays.width)
    ranks = np.frombuffer(arrays.ranks, "<i4")
    assert ids.shape[0] == 1 and len(ranks) == 1
    return ids[0].tolist(), values[0].astype(np.float64), int(ranks[0])


def with_params(row: Row, **changes: object) -> SamplingParams:
    return msgspec.structs.replace(row.params, **changes)


def asking_whole_vocabulary(row: Row) -> Row:
    return replace(row, params=with_params(row, logprobs=-1, logprobs_mode="processed_logits"))


# ------------------------------------------------------------------ checks
def check_processed(row: Row, survivors: Survivors | None, arrays: LogprobsArrays) -> None:
    """The whole vocabulary of the logits the token was drawn from: -inf exactly outside the survivors."""
    ids, values, _ = unpack(arrays)
    vocab = len(row.logits)
    assert sorted(ids[1:]) == list(range(vocab))
    drawn_from = np.full(vocab, np.nan)
    drawn_from[ids[1:]] = values[1:]
    if row.greedy:
        np.testing.assert_array_equal(drawn_from, np.array(row.logits))
        return
    kept = {t for t in range(vocab) if np.isfinite(drawn_from[t])}
    assert np.all(drawn_from[[t for t in range(vocab) if t not in kept]] == NEG_INF)
    if survivors is not None:
        assert survivors.admits(kept), (kept, survivors)
    expected = scaled_logits(row)[sorted(kept)]
    np.testing.assert_allclose(drawn_from[sorted(kept)], expected, rtol=1e-6)


def check_token(row: Row, token: int, survivors: Survivors | None) -> None:
    if row.greedy:
        assert token == row.logits.index(max(row.logits))  # the first maximal logit
        return
    if survivors is None:
        return
    assert token in survivors.sure | survivors.tied
    if row.params.seed is not None and not survivors.tied:
        assert token in race_winners(row, survivors), (token, race_winners(row, survivors))


def check_logprobs(row: Row, token: int, arrays: LogprobsArrays) -> None:
    """Raw logprobs: the own token's value and rank, then the N most likely, most likely first."""
    logits = np.array(row.logits)
    reference = logits - (logits.max() + math.log(np.exp(logits - logits.max()).sum()))
    num_top = len(logits) if row.params.logprobs == -1 else row.params.logprobs
    ids, values, rank = unpack(arrays)
    assert len(ids) == 1 + num_top and ids[0] == token
    assert rank == int((logits >= logits[token]).sum())
    top = ids[1:]
    assert len(set(top)) == num_top
    np.testing.assert_allclose(values, reference[ids], rtol=1e-5, atol=1e-5)
    assert all(logits[a] >= logits[b] for a, b in zip(top, top[1:]))
    others = [t for t in range(len(logits)) if t not in top]
    if top and others:
        assert logits[others].max() <= logits[top].min()


def check_seeded_rows_alone_and_reversed(rows: list[Row], tokens: list[int]) -> None:
    seeded = [i for i, r in enumerate(rows) if not r.greedy and r.params.seed is not None]
    reversed_tokens = run(rows[::-1], worker_seed=7)[0][::-1]
    for i in seeded:
        assert run([rows[i]], worker_seed=3)[0] == [tokens[i]]
        assert reversed_tokens[i] == tokens[i]


def check_extra_seeds_sample_survivors(row: Row, survivors: Survivors) -> None:
    copies = [replace(row, params=with_params(row, seed=seed, logprobs=None)) for seed in range(EXTRA_SEEDS)]
    for copy, token in zip(copies, run(copies)[0]):
        check_token(copy, token, survivors)


UNDERFLOW = (2.75, -2.75)
"""At temperature 0.05 the second token's probability rounds to 0 in float32."""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
@example([Row(UNDERFLOW, SamplingParams(temperature=0.05, logprobs=-1), 0),  # top_p 1 keeps it, whatever row 2 sets
          Row(UNDERFLOW, SamplingParams(top_p=0.5), 0)])
@example([Row((0.0, 0.0, NEG_INF), SamplingParams(top_p=0.5, logprobs=1), 3)])  # 0.5 reaches top_p 0.5: one token
def test_drawn_batches_sample_as_the_per_row_reference(rows: list[Row]) -> None:
    survivors = [None if r.greedy else reference_survivors(r) for r in rows]
    tokens, logprobs = run(rows)
    for row, token, row_survivors in zip(rows, tokens, survivors):
        check_token(row, token, row_survivors)
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    assert len(logprobs or []) == len(asking) and (logprobs is None) == (not asking)
    for i, arrays in zip(asking, logprobs or []):
        check_logprobs(rows[i], tokens[i], arrays)

    rerun_tokens, processed = run([asking_whole_vocabulary(r) for r in rows])
    assert rerun_tokens == tokens  # the same worker seed, and logprobs change no token
    assert processed is not None
    for row, row_survivors, arrays in zip(rows, survivors, processed):
        check_processed(row, row_survivors, arrays)

    check_seeded_rows_alone_and_reversed(rows, tokens)
    for row, row_survivors in zip(rows, survivors):
        if row_survivors is not None:
            check_extra_seeds_sample_survivors(row, row_survivors)
