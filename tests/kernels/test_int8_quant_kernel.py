"""kernels/int8_quant.py against kernels/reference.py: the per-token int8 quantizer of W8A8 int8 experts' inputs must
equal `reference.quantize_int8_per_token` (compressed-tensors' function, `asyncllm.models.int8`'s) bit for bit: the
int8 values and the float32 scales, at odd shapes, an all-zero row, large and tiny magnitudes, exact rounding
midpoints (half to even), a row whose largest magnitude is negative (-128), rows over several blocks, strided rows;
and the dense W8A8 layers' ``torch._int_mm`` path, whose outputs stay the same bits through the kernel."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import int8_quant, reference
from asyncllm.kernels.int8_quant import quantize_int8_per_token
from kernel_testing import DEVICE, randn


def _assert_equals_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_int8_per_token(x)
    ref_q, ref_scale = reference.quantize_int8_per_token(x.cpu())
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    assert torch.equal(q.cpu(), ref_q)
    assert torch.equal(scale.cpu().view(torch.int32), ref_scale.view(torch.int32))  # the scales' bits
    return q.cpu(), scale.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("rows, k", [(1, 1), (6, 37), (4, 300)])
def test_quantize_int8_per_token_equals_the_reference_bit_for_bit(dtype: torch.dtype, rows: int, k: int) -> None:
    x = randn(rows, k, dtype=dtype, seed=rows + k, scale=3.0)
    if rows > 1:
        x[0] = 0.0  # an all-zero row: zeros and float32's eps, not NaN
        half = dtype == torch.float16
        x[1] *= 1e3 if half else 1e30  # large magnitudes (float16's largest is 65504)
        x[2] *= 1e-4 if half else 1e-30  # tiny ones
        x[3] = x[3].clamp(-100.0, 100.0)
        x[3, 0] = -255.0  # the largest magnitude negative: scale 2, -127.5 rounds (half to even) to -128
    q, scale = _assert_equals_reference(x)
    if rows > 1:
        assert not q[0].any() and float(scale[0]) == torch.finfo(torch.float32).eps
        assert int(q[3, 0]) == -128 and int(q[3].max()) < 127


def test_quantize_int8_per_token_rounds_half_to_even() -> None:
    """Values on exact midpoints (scale 1: ``max|x| = 127.5``) go to the even integer, both signs; 127.5 saturates."""
    x = torch.tensor([[127.5, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5, 0.49999997, 126.5]], device=DEVICE)
    q, scale = _assert_equals_reference(x)
    assert float(scale) == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -4, 0, 126]]


def test_non_finite_rows_as_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN (here in a row's second block) makes its row's scale NaN and its values 0; an inf makes the scale inf and every
    value 0 (inf / inf is NaN, cast to 0): torch's results, not a finite scale that hides the NaN."""
    monkeypatch.setattr(int8_quant, "MAX_BLOCK", 2)
    x = torch.tensor([[3.0, 1.0, -2.0, float("nan")], [1.0, float("inf"), -1.0, 0.5], [1.0, 2.0, -4.0, 0.5]],
                     device=DEVICE)
    q, scale = quantize_int8_per_token(x)
    ref_q, ref_scale = reference.quantize_int8_per_token(x.cpu())
    assert torch.isnan(scale[0]).all() and torch.isnan(ref_scale[0]).all()
    assert float(scale[1]) == float(ref_scale[1]) == float("inf")
    assert not q[:2].any() and torch.equal(q.cpu(), ref_q)
    assert torch.equal(scale[2:].cpu(), ref_scale[2:])


def test_quantize_int8_per_token_over_several_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows wider than a program's block (`MAX_BLOCK` lowered to 16: 300 columns in 19 blocks, the last partial), the
    largest magnitude in the last block, rows read through a stride."""
    monkeypatch.setattr(int8_quant, "MAX_BLOCK", 16)
    wide = randn(3, 320, dtype=torch.float16, seed=7)
    x = wide[:, :300]
    x[1, 299] = 500.0
    q, scale = _assert_equals_reference(x)
    assert int(q[1, 299]) == 127 and float(scale[1]) == float(torch.tensor(500.0) / 127.5)


def test_quantize_int8_per_token_refuses_what_it_cannot_read() -> None:
    for x, message in ((torch.zeros(2, 4, dtype=torch.int8), "x must be float32, float16 or bfloat16"),
                       (torch.zeros(2, 4, 2), "x must have 2 dims"),
                       (torch.zeros(4, 3).t(), "x must be contiguous in its last dim")):
        with pytest.raises(ValueError, match=message):
            quantize_int8_per_token(x.to(DEVICE))
    q, scale = quantize_int8_per_token(torch.zeros(0, 5, device=DEVICE))
    assert q.shape == (0, 5) and scale.shape == (0, 1)


def test_the_micro_benchmark_times_kernel_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncllm bench kernels`' quantizer rows on a tiny shape (each call run once, not timed): both sides agree."""
    from asyncllm.bench import kernels as bench

    calls = []
    monkeypatch.setattr(bench, "time_ms", lambda fn: calls.append(fn()) or 0.001)
    rows = bench._int8_quant({"hidden_size": 24, "intermediate_size": 40}, torch.float32, 1e12, device=str(DEVICE),
                             token_counts=(1, 3))
    assert [r["shape"] for r in rows] == ["1x24", "3x24", "1x40", "3x40"] and len(calls) == 8
    for (q, scale), (ref_q, ref_scale) in zip(calls[0::2], calls[1::2]):
        assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_dense_int_mm_path_is_unchanged_through_the_kernel(monkeypatch: pytest.MonkeyPatch,
                                                               dtype: torch.dtype) -> None:
    """`Int8LinearMethod`'s ``torch._int_mm`` path (forced here, as on CUDA) with its per-token input quantized by the
    kernel (``use_triton``, CUDA's default) against `quantize_int8_per_token`: the same output bits; the kernel is
    asked once a call."""
    from asyncllm.models.int8 import attach_int8_weight, quantize_int8_weight
    from asyncllm.models.layers import TensorParallel
    from asyncllm.models.linear import RowParallelLinear

    calls = []
    monkeypatch.setattr(int8_quant, "quantize_int8_per_token",
                        lambda x: calls.append(x.shape) or quantize_int8_per_token(x))
    w_q, w_scale = quantize_int8_weight(randn(48, 64, dtype=torch.float32, seed=11, scale=0.05))
    layers = []
    for use_triton in (True, False):
        with torch.device(DEVICE):
            layer = RowParallelLinear(64, 48, False, TensorParallel(), dtype)
        method = attach_int8_weight(layer, w_q, w_scale, int_mm=True, use_triton=use_triton)
        assert method.int_mm and method.use_triton is use_triton
        layers.append(layer)
    for rows in (1, 17):
        x = randn(2, rows, 64, dtype=dtype, seed=rows, scale=2.0)
        got, want = layers[0](x), layers[1](x)
        assert got.shape == (2, rows, 48) and torch.equal(got, want)
    assert calls == [(2, 64), (34, 64)]
