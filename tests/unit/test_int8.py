"""W8A8 int8 layers (asyncllm/models/int8.py): the activation quantization against compressed-tensors' own (bit for
bit, ties and saturation included), the ``torch._int_mm`` product against the dequantize fallback (on the CPU, where
torch has an int8 GEMM too, and on CUDA), the padding of small batches. The checkpoints are in
tests/unit/test_compressed_tensors.py."""

from __future__ import annotations

import pytest
import torch

from asyncllm.models.int8 import (
    Int8LinearMethod,
    attach_int8_weight,
    int8_linear_fallback,
    int8_mm,
    quantize_int8,
    quantize_int8_input,
    quantize_int8_per_token,
    quantize_int8_weight,
)
from asyncllm.models.layers import TensorParallel
from asyncllm.models.linear import RowParallelLinear


def _args(strategy: str, dynamic: bool):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="int", strategy=strategy, dynamic=dynamic, symmetric=True)


def test_rounding_is_half_to_even_and_clamped_to_int8() -> None:
    """``round(clamp(x / s, -128, 127))``: ties to the even neighbour (not away from zero), 127.5 saturates to 127,
    -128.5 to -128."""
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.4, 127.5, 300.0, -127.5, -128.4, -128.5, -300.0])
    want = [0, 2, 2, 0, -2, -2, 126, 127, 127, 127, -128, -128, -128, -128]
    assert quantize_int8(x, torch.tensor(1.0)).tolist() == want
    assert quantize_int8(x * 0.25, torch.tensor(0.25)).tolist() == want


def test_activation_quantization_is_compressed_tensors_own() -> None:
    """Per token (the W8A8 preset: ``max|x_row| / 127.5``, a zero row's scale float32's eps) and static per tensor,
    the scales and int8 values of compressed-tensors' ``compute_dynamic_scales_and_zp`` and ``quantize``, bit for
    bit, on rows of every magnitude, a zero row and rows whose largest value is negative (quantized to -128)."""
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 48, generator=gen) * torch.logspace(-4, 3, 9)[:, None]
    x[3] = 0.0
    x[4, 7] = -50.0
    token = _args("token", True)  # per token of a [batch, tokens, features] input, as transformers passes it
    scale, zero_point = compute_dynamic_scales_and_zp(x[None], token, module=None)
    q, our_scale = quantize_int8_per_token(x)
    assert torch.equal(our_scale, scale[0]) and our_scale[3].item() == torch.finfo(torch.float32).eps
    assert torch.equal(q, quantize(x[None], scale, zero_point, token, dtype=torch.int8)[0])
    assert q[4, 7].item() == -128 and q.dtype == torch.int8
    static = torch.tensor([0.03])
    q, rows = quantize_int8_input(x, static)
    assert torch.equal(q, quantize(x, static, torch.zeros(1, dtype=torch.int8), _args("tensor", False),
                                   dtype=torch.int8))
    assert torch.equal(rows, torch.full((9, 1), 0.03))


def test_the_fallback_is_dequantize_then_linear() -> None:
    """``F.linear(dq(x_q), dq(W_q), b)`` in float32, cast once: the hand computation in bfloat16 too."""
    gen = torch.Generator().manual_seed(1)
    w_q, w_scale = quantize_int8_weight(torch.randn(24, 40, generator=gen))
    bias = torch.randn(24, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 5, 40, generator=gen).to(torch.bfloat16)
    x_q, x_scale = quantize_int8_per_token(x.reshape(10, 40))
    want = ((x_q.float() * x_scale) @ (w_q.float() * w_scale).t() + bias.float()).to(torch.bfloat16)
    got = int8_linear_fallback(x, w_q, w_scale, bias, torch.bfloat16)
    assert got.shape == (2, 5, 24) and torch.equal(got.reshape(10, 24), want)


@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_int8_mm_pads_small_batches(rows: int) -> None:
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(-128, 128, (rows, 32), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (24, 32), generator=gen, dtype=torch.int8)
    assert torch.equal(int8_mm(a, w.t()), a.int() @ w.int().t())


INT_MM_VS_FALLBACK = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
"""|_int_mm path - fallback| over the output's largest magnitude: float32 sums in another order (exact int32 sums
scaled after, against float32 products summed), then one rounding to the dtype (a half type's results may be one of
its ulps apart: 2^-8 bfloat16, 2^-11 float16)."""


def _layer(device: torch.device, dtype: torch.dtype, int_mm: bool | None, static_input: bool):
    gen = torch.Generator(device=device).manual_seed(3)
    with torch.device(device):
        layer = RowParallelLinear(256, 384, True, TensorParallel(), dtype)
        layer.bias.data.copy_(torch.randn(384, generator=gen) * 0.05)
        w_q, w_scale = quantize_int8_weight(torch.randn(384, 256, generator=gen) * 0.05)
        input_scale = torch.tensor(0.02) if static_input else None
    method = attach_int8_weight(layer, w_q, w_scale, input_scale, int_mm)
    return layer, method, gen


def _check_int_mm_path(device: torch.device, dtype: torch.dtype, static_input: bool, int_mm: bool | None) -> None:
    layer, method, gen = _layer(device, dtype, int_mm, static_input)
    assert isinstance(method, Int8LinearMethod) and method.int_mm and method.static_input is static_input
    tol = INT_MM_VS_FALLBACK[dtype]
    for rows in (1, 7, 16, 17, 64):
        x = torch.randn(rows, 256, device=device, generator=gen).to(dtype)
        got = layer(x)
        want = int8_linear_fallback(x, layer.weight, layer.weight_scale, layer.bias, dtype,
                                    layer.input_scale if static_input else None)
        assert got.dtype == dtype and got.shape == (rows, 384)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static_input", [False, True])
def test_the_int_mm_path_equals_the_fallback_on_the_cpu(dtype: torch.dtype, static_input: bool) -> None:
    """The GPU's arithmetic (``torch._int_mm``, scaled after in float32), forced on the CPU, whose torch runs
    ``_int_mm`` too; the CPU serves through the fallback."""
    cpu = torch.device("cpu")
    assert not _layer(cpu, dtype, None, static_input)[1].int_mm
    _check_int_mm_path(cpu, dtype, static_input, int_mm=True)


# ------------------------------------------------------------------ CUDA (skipped without a device)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("static_input", [False, True])
def test_int_mm_on_cuda_equals_the_fallback(dtype: torch.dtype, static_input: bool) -> None:
    """cuBLAS's int8 GEMM through ``torch._int_mm`` (chosen at load: K and N multiples of 8), batches of 16 rows or
    fewer padded to 17, against the dequantize fallback on the same int8 tensors."""
    _check_int_mm_path(torch.device("cuda"), dtype, static_input, int_mm=None)
    torch.cuda.synchronize()
