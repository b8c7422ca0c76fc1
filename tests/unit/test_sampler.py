"""The sampler: exact filters, greedy ties, seeded reproducibility, and distributions.

Goodness-of-fit tests are seeded (so they are deterministic) and use the
significance level ALPHA: a correct sampler fails one with probability 1e-3
for an arbitrary seed, and the fixed seeds used here pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncllm.sampling import SamplingParams
from asyncllm.workers.sampler import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p, mix_seed

CPU = torch.device("cpu")
ALPHA = 1e-3
LOGITS_5 = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int] | None = None,
           sampler: Sampler | None = None) -> list[int]:
    positions = positions if positions is not None else [10] * len(params)
    metadata = SamplingMetadata.from_params(params, positions, CPU)
    return (sampler or Sampler(0, CPU))(logits, metadata).sampled_token_ids.tolist()


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """P(chi2 >= statistic) with len-1 degrees of freedom (survival = regularised upper gamma)."""
    expected = probs * counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def draw_counts(params: SamplingParams, num_draws: int, vocab: int = 5) -> np.ndarray:
    logits = LOGITS_5.expand(num_draws, vocab).contiguous()
    tokens = sample(logits, [params] * num_draws, sampler=Sampler(1234, CPU))
    return np.bincount(tokens, minlength=vocab)


# ------------------------------------------------------------------ greedy
def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0, 3.0], [-5.0, -4.0, -6.0, -4.5]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 3) == [1, 0, 1]


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.999]])
    assert sample(logits, [SamplingParams(temperature=1e-7)]) == [1]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)],
    ids=["top_k=1", "top_p=1e-6"],
)
def test_filters_that_keep_one_token_equal_greedy(params: SamplingParams) -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(3))
    assert sample(logits, [params] * 64) == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    tokens = sample(logits, params)
    assert [tokens[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


# ------------------------------------------------------------------ filters, exact
def test_top_k_keeps_exactly_k_and_off_values_keep_all() -> None:
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.0]] * 3)
    out = apply_top_k_top_p(logits, torch.tensor([2, 5, 1]), None)
    inf = float("-inf")
    assert out.tolist() == [[inf, 4.0, inf, 3.0, inf], [1.0, 4.0, 2.0, 3.0, 0.0], [inf, 4.0, inf, inf, inf]]
    meta = SamplingMetadata.from_params([SamplingParams(top_k=0), SamplingParams(top_k=-1)], [0, 0], CPU)
    assert meta.top_k is None  # "off" values need no sort at all


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(apply_top_k_top_p(logits, None, torch.tensor([p]))).tolist()[0]  # noqa: E731
    assert kept(0.4) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.8) == [True, True, True, False]
    assert kept(1.0) == [True, True, True, True]


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.2, 0.01]]).log()
    out = apply_min_p(logits, torch.tensor([0.5]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    counts = draw_counts(SamplingParams(min_p=0.6), 4000)  # LOGITS_5 probs / max: 1, .61, .37, ...
    assert counts[2:].sum() == 0 and counts[0] > 0 and counts[1] > 0


def test_min_p_applies_before_top_p() -> None:
    """vLLM's order: min-p first, then top-p's nucleus over what min-p kept (renormalised). Here min-p keeps
    {0, 1} (.625, .375 renormalised) and top-p 0.6 then keeps {0} alone; top-p first would keep {0, 1}."""
    logits = torch.tensor([0.5, 0.3, 0.1, 0.1]).log().expand(200, 4).contiguous()
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=0.6, min_p=0.3)] * 200) == [0] * 200
    assert set(sample(logits, [SamplingParams(temperature=1.0, top_p=0.6)] * 200)) == {0, 1}


# ------------------------------------------------------------------ seeded reproducibility
def seeded_sequence(sampler: Sampler, logits: torch.Tensor, seed: int, batch: int, where: int) -> list[int]:
    """Tokens of one seeded row over 20 positions, placed at row `where` of a batch of noise rows."""
    out = []
    for pos in range(100, 120):
        params = [SamplingParams(temperature=0.9, seed=None if i % 2 else 1000 + i) for i in range(batch)]
        params[where] = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        rows = logits.expand(batch, -1).contiguous()
        positions = [pos + 7 * i for i in range(batch)]
        positions[where] = pos
        out.append(sample(rows, params, positions, sampler)[where])
    return out


def test_seeded_rows_are_identical_alone_in_a_batch_and_across_samplers() -> None:
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(5)) * 0.1
    alone = seeded_sequence(Sampler(0, CPU), logits, seed=42, batch=1, where=0)
    assert len(set(alone)) > 10  # a near-flat distribution: the test can tell seeds apart
    assert seeded_sequence(Sampler(0, CPU), logits, seed=42, batch=5, where=3) == alone
    assert seeded_sequence(Sampler(99, CPU), logits, seed=42, batch=4, where=0) == alone
    assert seeded_sequence(Sampler(0, CPU), logits, seed=43, batch=1, where=0) != alone


def test_unseeded_rows_follow_the_worker_seed() -> None:
    logits = torch.zeros(8, 1000)
    params = [SamplingParams()] * 8
    assert sample(logits, params, sampler=Sampler(7, CPU)) == sample(logits, params, sampler=Sampler(7, CPU))
    assert sample(logits, params, sampler=Sampler(7, CPU)) != sample(logits, params, sampler=Sampler(8, CPU))


def test_mix_seed_is_stable_and_spreads() -> None:
    assert mix_seed(0, 0) == mix_seed(0, 0)
    values = {mix_seed(seed, pos) for seed in range(20) for pos in range(20)}
    assert len(values) == 400 and all(0 <= v < 2**63 for v in values)


# ------------------------------------------------------------------ distributions
def softmax(x: torch.Tensor) -> np.ndarray:
    return torch.softmax(x.double(), -1).numpy()


def test_temperature_sampling_fits_the_softmax() -> None:
    counts = draw_counts(SamplingParams(temperature=0.7), 20000)
    assert chi_square_p_value(counts, softmax(LOGITS_5 / 0.7)) > ALPHA


def test_seeded_sampling_fits_the_softmax() -> None:
    num = 3000
    params = [SamplingParams(temperature=1.3, seed=s) for s in range(num)]
    tokens = sample(LOGITS_5.expand(num, 5).contiguous(), params)
    assert chi_square_p_value(np.bincount(tokens, minlength=5), softmax(LOGITS_5 / 1.3)) > ALPHA


def test_top_k_renormalises_over_the_kept_tokens() -> None:
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=3), 20000)
    assert counts[3:].sum() == 0
    assert chi_square_p_value(counts[:3], softmax(LOGITS_5[:3])) > ALPHA


def test_top_p_renormalises_over_the_nucleus() -> None:
    probs = softmax(LOGITS_5)  # 0.429, 0.260, 0.158, 0.096, 0.058: cumulative 0.429, 0.689, 0.846
    assert probs[:2].sum() < 0.75 < probs[:3].sum()
    counts = draw_counts(SamplingParams(temperature=1.0, top_p=0.75), 20000)
    assert counts[3:].sum() == 0
    assert chi_square_p_value(counts[:3], softmax(LOGITS_5[:3])) > ALPHA


def test_chi_square_helper_rejects_a_wrong_distribution() -> None:
    counts = draw_counts(SamplingParams(temperature=1.0), 20000)
    assert chi_square_p_value(counts, softmax(LOGITS_5)) > ALPHA
    assert chi_square_p_value(counts, softmax(LOGITS_5 / 1.2)) < ALPHA
    assert math.isclose(chi_square_p_value(np.array([50, 50]), np.array([0.5, 0.5])), 1.0)


def test_min_p_renormalises_over_the_kept_tokens() -> None:
    counts = draw_counts(SamplingParams(temperature=1.0, min_p=0.3), 20000)  # probs / max: 1, .61, .37, .22, .14
    assert counts[3:].sum() == 0
    assert chi_square_p_value(counts[:3], softmax(LOGITS_5[:3])) > ALPHA


def test_penalised_sampling_fits_the_penalised_softmax() -> None:
    num = 20000
    params = SamplingParams(temperature=0.8, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.5)
    meta = SamplingMetadata.from_params([params] * num, [10] * num, CPU, [[4]] * num, [[0, 0, 1]] * num)
    tokens = Sampler(1234, CPU)(LOGITS_5.expand(num, 5).contiguous(), meta).sampled_token_ids
    # repetition on prompt + output tokens {0, 1, 4}, then frequency (counts 2, 1) and presence on outputs
    penalised = torch.tensor([1.0 / 1.5 - 0.6 - 0.4, 0.5 / 1.5 - 0.3 - 0.4, 0.0, -0.5, -1.0 * 1.5])
    assert chi_square_p_value(np.bincount(tokens.numpy(), minlength=5), softmax(penalised / 0.8)) > ALPHA
    assert chi_square_p_value(np.bincount(tokens.numpy(), minlength=5), softmax(LOGITS_5 / 0.8)) < ALPHA
