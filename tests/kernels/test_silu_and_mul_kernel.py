"""Triton SiLU-and-mul and GeGLU's gelu-tanh-and-mul against `reference`."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.silu_and_mul import gelu_tanh_and_mul, silu_and_mul
from kernel_testing import DTYPES, ELEMENTWISE_TOL, assert_close, randn, requires_gpu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 18), (3, 2, 96), (9, 2 * 1500)], ids=str)  # d=1500 spans two blocks
def test_silu_and_mul_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = randn(*shape, dtype=dtype, seed=0, scale=4.0)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, reference.silu_and_mul(x), ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 18), (9, 2 * 1500)], ids=str)
def test_gelu_tanh_and_mul_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Gates over [-12, 12]: tanh's saturated tails and its steep middle."""
    x = randn(*shape, dtype=dtype, seed=3, scale=4.0)
    out = gelu_tanh_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, reference.gelu_tanh_and_mul(x), ELEMENTWISE_TOL[dtype])


def test_launcher_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(randn(3, 7, dtype=torch.float32, seed=1))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        silu_and_mul(torch.ones(3, 8, dtype=torch.int32))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [3072, 14336])
def test_silu_and_mul_real_shapes(intermediate: int, dtype: torch.dtype) -> None:
    x = randn(4096, 2 * intermediate, dtype=dtype, seed=2, scale=4.0)
    assert_close(silu_and_mul(x), reference.silu_and_mul(x), ELEMENTWISE_TOL[dtype])
