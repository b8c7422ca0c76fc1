"""Triton decode matrix-vector products (with a fused prologue) against `reference.decode_linear`."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.decode_linear import MAX_ROWS, block_sizes, decode_linear
from asyncllm.kernels.rms_norm import fused_add_rms_norm
from asyncllm.kernels.silu_and_mul import silu_and_mul
from kernel_testing import DTYPES, ELEMENTWISE_TOL, assert_close, randn, requires_gpu

# (atol, rtol): float32 sums of K products in another order; half types one rounding of the sum apart
LINEAR_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-3), torch.bfloat16: (1.5e-1, 1.6e-2)}


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, prologue: str | None, bias: bool) -> dict:
    width = 2 * k if prologue == "silu_and_mul" else k
    args = dict(x=randn(rows, width, dtype=dtype, seed=0), weight=randn(n, k, dtype=dtype, seed=1, scale=0.1),
                bias=randn(n, dtype=dtype, seed=2) if bias else None, prologue=prologue)
    if prologue == "add_rms_norm":
        args.update(residual=randn(rows, k, dtype=dtype, seed=3), norm_weight=randn(k, dtype=dtype, seed=4), eps=1e-5)
    return args


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prologue", [None, "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize(("rows", "n", "k", "bias"),  # odd sizes: masked tails; K = 1030 takes three K steps
                         [(1, 37, 100, False), (3, 130, 300, True), (MAX_ROWS, 8, 1030, False)],
                         ids=["1x37x100", "3x130x300-bias", "16x8x1030"])
def test_decode_linear_matches_reference(dtype: torch.dtype, prologue: str | None, rows: int, n: int, k: int,
                                         bias: bool) -> None:
    args = _inputs(rows, n, k, dtype, prologue, bias)
    out, expected = decode_linear(**args), reference.decode_linear(**args)
    if prologue == "add_rms_norm":
        (out, residual), (expected, expected_residual) = out, expected
        assert_close(residual, expected_residual, ELEMENTWISE_TOL[dtype])
    assert out.shape == (rows, n) and out.dtype == dtype
    assert_close(out, expected, LINEAR_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_silu_prologue_reads_what_the_silu_kernel_writes(dtype: torch.dtype) -> None:
    """Fused or not, the product's input is the same: bit-identical outputs (same kernel, same order)."""
    args = _inputs(2, 45, 200, dtype, "silu_and_mul", bias=False)
    fused = decode_linear(**args)
    unfused = decode_linear(silu_and_mul(args["x"]), args["weight"])
    assert torch.equal(fused, unfused)


def test_the_norm_prologue_writes_the_residual_once() -> None:
    """Only the first column block's programs store the new residual; every column reads the same norm."""
    args = _inputs(2, 200, 64, torch.float32, "add_rms_norm", bias=False)
    assert block_sizes(200, 64)[0] < 200  # several column blocks
    out, residual = decode_linear(**args)
    normed, expected_residual = fused_add_rms_norm(args["x"], args["residual"], args["norm_weight"], args["eps"])
    assert torch.equal(residual, expected_residual)
    assert_close(out, reference.decode_linear(normed, args["weight"]), LINEAR_TOL[torch.float32])


def test_launcher_rejects_bad_arguments() -> None:
    x, w = randn(2, 16, dtype=torch.float32, seed=0), randn(8, 16, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="at most 16"):
        decode_linear(randn(MAX_ROWS + 1, 16, dtype=torch.float32, seed=0), w)
    with pytest.raises(ValueError, match="weight must be"):
        decode_linear(x, randn(8, 15, dtype=torch.float32, seed=1))
    with pytest.raises(ValueError, match="needs a residual"):
        decode_linear(x, w, prologue="add_rms_norm", norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match="prologue must be one of"):
        decode_linear(x, w, prologue="gelu")
    with pytest.raises(ValueError, match="weight must be"):  # silu_and_mul halves x's width
        decode_linear(x, w, prologue="silu_and_mul")


def test_block_sizes_spread_the_work() -> None:
    """About 512 column blocks of 2 to 8 columns, K steps of up to 1024: the H200 sweep's best (docs/kernels.md)."""
    assert block_sizes(1024, 3072) == (2, 1024)  # Qwen3-0.6B's down and output products: 512 thin column blocks
    assert block_sizes(4096, 1024) == (8, 1024)  # its QKV: 512 blocks of 8
    assert block_sizes(6144, 1024) == (8, 1024)  # gate-up: at most 8 columns (768 blocks)
    assert block_sizes(37, 100) == (2, 128)  # a tiny product: at least 2 columns, one K step


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize(("prologue", "n", "k"), [("add_rms_norm", 4096, 1024), ("silu_and_mul", 1024, 3072),
                                                  (None, 151936, 1024), ("add_rms_norm", 6144, 4096)])
def test_decode_linear_real_shapes(dtype: torch.dtype, rows: int, prologue: str | None, n: int, k: int) -> None:
    args = _inputs(rows, n, k, dtype, prologue, bias=False)
    out, expected = decode_linear(**args), reference.decode_linear(**args)
    if prologue == "add_rms_norm":
        (out, _), (expected, _) = out, expected
    assert_close(out, expected, LINEAR_TOL[dtype])


def test_the_micro_benchmark_measures_each_product_fused_and_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncllm bench kernels`' decode_linear rows, on a tiny shape (each call run once, not timed)."""
    from asyncllm.bench import kernels as bench

    calls = []
    monkeypatch.setattr(bench, "time_ms", lambda fn: calls.append(fn()) or 0.001)
    cfg = dict(hidden_size=32, intermediate_size=48, vocab_size=40, num_attention_heads=4, num_key_value_heads=2)
    rows = bench._decode_linear(cfg, torch.float32, 1e12, device=str(randn(1, dtype=torch.float32, seed=0).device))
    assert [r["shape"] for r in rows[:5]] == ["1x32->64", "1x32->96", "1x48->32", "1x32->32", "1x32->40"]
    assert [r["shape"] for r in rows[5::5]] == ["2x32->64", "4x32->64"]  # 1, FUSED_ROWS and twice it
    assert len(rows) == 15 and all(r["speedup"] == 1.0 for r in rows)
    for fused, unfused in zip(calls[0::2], calls[1::2]):  # the fused kernel computes what it replaces
        fused = fused[0] if isinstance(fused, tuple) else fused
        assert_close(fused, unfused, LINEAR_TOL[torch.float32])
