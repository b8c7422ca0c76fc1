"""The Triton gated-delta decode step (kernels/gated_delta.py) against `reference.gated_delta_step`: requests on
scattered state rows (the others untouched), Dk and Dv not powers of two, float32 sums in another order."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.gated_delta import gated_delta_step
from kernel_testing import DEVICE

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dk, dv", [(16, 8), (24, 40), (128, 128)])
def test_gated_delta_step_matches_reference(dk: int, dv: int) -> None:
    gen = torch.Generator().manual_seed(dk + dv)
    n, heads, num_rows = 3, 4, 7
    states = torch.randn(num_rows, heads, dk, dv, generator=gen).to(DEVICE)
    rows = torch.tensor([5, 0, 3]).to(DEVICE)
    q, k = (torch.nn.functional.normalize(torch.randn(n, heads, dk, generator=gen), dim=-1).to(DEVICE)
            for _ in range(2))
    v = torch.randn(n, heads, dv, generator=gen).to(DEVICE)
    g, beta = (-torch.rand(n, heads, generator=gen)).to(DEVICE), torch.rand(n, heads, generator=gen).to(DEVICE)
    expected_states = states.clone()
    expected = reference.gated_delta_step(expected_states, rows, q, k, v, g, beta)
    out = gated_delta_step(states, rows, q, k, v, g, beta)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(states, expected_states, **TOL)  # rows 1, 2, 4, 6 untouched in both


def test_the_launcher_rejects_bad_arguments() -> None:
    states = torch.zeros(2, 1, 4, 4)
    q = torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="states must be float32"):
        gated_delta_step(states.half(), torch.tensor([0]), q, q, q, torch.zeros(1, 1), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="v must be float32"):
        gated_delta_step(states, torch.tensor([0]), q, q, torch.zeros(1, 1, 5), torch.zeros(1, 1), torch.zeros(1, 1))
    # a strided rows view [0, 1] was read at ptr + i: request 1 stepped row 7, past the 2 states (no error)
    states, q2, g2 = torch.zeros(2, 1, 4, 4), torch.ones(2, 1, 4), torch.zeros(2, 1)
    strided = torch.tensor([0, 7, 1, 7])[::2]
    with pytest.raises(ValueError, match="rows must be contiguous"):
        gated_delta_step(states, strided, q2, q2, q2, g2, g2)


def test_the_micro_benchmark_times_kernel_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncllm bench kernels`' hybrid decode-step rows (gated delta, Mamba2) on tiny shapes (each call run once,
    not timed)."""
    from asyncllm.bench import kernels as bench

    calls = []
    monkeypatch.setattr(bench, "time_ms", lambda fn: calls.append(fn()) or 0.001)
    rows = bench._state_steps(1e12, device=str(DEVICE), gated_delta=(2, 16, 8), ssd=(3, 8, 16))
    assert [r["shape"] for r in rows] == ["1x2x16x8", "32x2x16x8", "128x2x16x8", "1x3x8x16", "32x3x8x16",
                                          "128x3x8x16"] and len(calls) == 12
    assert [tuple(out.shape[1:]) for out in calls] == [(2, 8)] * 6 + [(3, 8)] * 6
    assert (bench.GATED_DELTA_HEADS, bench.SSD_HEADS) == ((48, 128, 128), (128, 64, 128))
