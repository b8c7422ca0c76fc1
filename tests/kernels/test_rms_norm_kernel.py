"""Triton RMSNorm (plain and fused with the residual add; Llama's and Gemma's) against `reference`."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.rms_norm import fused_add_rms_norm, gemma_fused_add_rms_norm, gemma_rms_norm, rms_norm
from kernel_testing import DTYPES, ELEMENTWISE_TOL, assert_close, randn, requires_gpu

SHAPES = [(1, 8), (7, 100), (3, 5, 96), (33, 1000)]  # odd rows and widths (not powers of two), a 3-D input


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = randn(*shape, dtype=dtype, seed=0, scale=3.0)
    weight = randn(shape[-1], dtype=dtype, seed=1)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, reference.rms_norm(x, weight, 1e-6), ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_add_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, residual = randn(*shape, dtype=dtype, seed=2), randn(*shape, dtype=dtype, seed=3, scale=4.0)
    weight = randn(shape[-1], dtype=dtype, seed=4)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)  # one rounded add: exact
    assert_close(out, expected_out, ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 100), (3, 5, 96)], ids=str)
def test_gemma_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Gemma's norm: ``(1 + weight)``, one rounding at the end; plain and after the residual add."""
    x, residual = randn(*shape, dtype=dtype, seed=12, scale=3.0), randn(*shape, dtype=dtype, seed=13)
    weight = randn(shape[-1], dtype=dtype, seed=14)
    assert_close(gemma_rms_norm(x, weight, 1e-6), reference.gemma_rms_norm(x, weight, 1e-6), ELEMENTWISE_TOL[dtype])
    out, new_residual = gemma_fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_residual = reference.gemma_fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, expected_residual)
    assert_close(out, expected_out, ELEMENTWISE_TOL[dtype])


def test_strided_rows_and_empty_input() -> None:
    """Rows of a wider tensor (a view with a row stride), and zero rows."""
    wide = randn(6, 40, dtype=torch.float32, seed=5)
    x, weight = wide[:, :24], randn(24, dtype=torch.float32, seed=6)
    assert_close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), ELEMENTWISE_TOL[torch.float32])
    assert rms_norm(wide[:0, :24], weight, 1e-6).shape == (0, 24)


def test_launcher_rejects_bad_arguments() -> None:
    x = randn(4, 16, dtype=torch.float32, seed=7)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm(x, randn(16, dtype=torch.float16, seed=8), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, randn(15, dtype=torch.float32, seed=8), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(x.t(), randn(4, dtype=torch.float32, seed=8), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        fused_add_rms_norm(x, x.half(), randn(16, dtype=torch.float32, seed=8), 1e-6)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1024, 4096, 5120])
def test_rms_norm_real_shapes(hidden: int, dtype: torch.dtype) -> None:
    x, residual = randn(8192, hidden, dtype=dtype, seed=9), randn(8192, hidden, dtype=dtype, seed=10)
    weight = randn(hidden, dtype=dtype, seed=11)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, expected_residual)
    assert_close(out, expected_out, ELEMENTWISE_TOL[dtype])
