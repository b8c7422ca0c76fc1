"""Shared settings of the kernel tests: device, dtypes and the tolerance stated for each."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"

requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

_BF16_UNSUPPORTED = pytest.mark.skipif(
    INTERPRETED,
    reason="Triton's interpreter (3.x) truncates float32->bfloat16 casts and mis-computes bfloat16 tl.dot",
)
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=_BF16_UNSUPPORTED),
]

# (atol, rtol) for elementwise ops that round like torch: float32 to reduction-order noise,
# half types to 2 units in the last place (the kernel and torch may round one step apart).
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
# attention outputs are O(1) weighted means; half types also round the probabilities before P @ V
ATTENTION_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2.5e-2, 2.5e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    atol, rtol = tol
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)
