"""kernels/w4a16.py against kernels/reference.py: the integer weight-only GEMM of AWQ / GPTQ checkpoints, at small
odd shapes: one row, M past a tile, N not a multiple of the tile, K past the last full group, a group size that is
no power of two, 8-bit values, a shuffled act-order g_idx, every packed value drawn over the whole int32 range
(so the top value's sign bit is set).

Tolerances: the dequantized weights are the reference's exactly (float32 arithmetic on the same values, one
rounding to x's dtype), so the output differs only by the order of float32 sums: float32 within 1e-5 of the
output's largest magnitude; float16 adds one rounding of the result: `ELEMENTWISE_TOL`. bfloat16: one unit in the
last place (2^-7 relative) of each dequantized weight and of the result, ``2^-7 (|x| @ |W| + |out|)`` per element:
Triton's CPU interpreter rounds float32 to bfloat16 by truncation (measured: its weights equal the truncated
reference's exactly), where a GPU rounds to nearest even.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, ELEMENTWISE_TOL, assert_close, randn

from asyncllm.kernels import reference
from asyncllm.kernels.w4a16 import w4a16_matmul


def _operands(k: int, n: int, bits: int, group: int, act_order: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (k * bits // 32, n), generator=gen, dtype=torch.int32)
    groups = -(-k // group)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).half()
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    return [t if t is None else t.to(DEVICE) for t in (qweight, scales, zeros, g_idx)]


SHAPES = [  # m, n, k, bits, group, act_order
    (1, 40, 64, 4, 16, False),  # one row (a decode step)
    (19, 72, 96, 4, 32, True),  # act-order groups, M past one 16-row tile
    (5, 24, 80, 4, 48, False),  # a group size that is no power of two; K past the last full group
    (33, 16, 64, 8, 64, False),  # 8-bit values (GPTQ)
    (3, 56, 48, 8, 16, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m, n, k, bits, group, act_order", SHAPES)
def test_w4a16_matmul_equals_the_reference(m: int, n: int, k: int, bits: int, group: int, act_order: bool,
                                           dtype: torch.dtype) -> None:
    qweight, scales, zeros, g_idx = _operands(k, n, bits, group, act_order, seed=m + n + k)
    x = randn(m, k, dtype=dtype, seed=m)
    out = w4a16_matmul(x, qweight, scales, zeros, g_idx, bits, group)
    expected = reference.w4a16_matmul(*(t if t is None else t.cpu() for t in (x, qweight, scales, zeros, g_idx)),
                                      bits, group)
    assert out.shape == (m, n) and out.dtype == dtype
    if dtype == torch.float32:
        assert_close(out, expected, (1e-5 * float(expected.abs().max()), 1e-5))
    elif dtype == torch.float16:
        assert_close(out, expected, ELEMENTWISE_TOL[dtype])
    else:  # one bfloat16 unit (2^-7 relative) per dequantized weight and on the result: the interpreter truncates
        w = reference.dequantize_int_weight(*(t if t is None else t.cpu() for t in (qweight, scales, zeros, g_idx)),
                                            bits, group)
        bound = 2**-7 * (x.float().abs().cpu() @ w.abs() + expected.float().abs())
        assert bool(((out.float().cpu() - expected.float()).abs() <= bound).all())


def test_a_strided_activation_and_float32_scales() -> None:
    """Rows of a wider buffer (row stride > K), float32 scales (a checkpoint whose scales are no float16 values)."""
    m, n, k = 4, 32, 64
    qweight, scales, zeros, _ = _operands(k, n, 4, 32, False, seed=7)
    wide = torch.zeros(m, k + 8, device=DEVICE)
    wide[:, :k] = randn(m, k, dtype=torch.float32, seed=8)
    out = w4a16_matmul(wide[:, :k], qweight, scales.float() / 3, zeros.float(), None, 4, 32)
    expected = reference.w4a16_matmul(wide[:, :k].cpu(), qweight.cpu(), scales.float().cpu() / 3, zeros.float().cpu(),
                                      None, 4, 32)
    assert_close(out, expected, (1e-5 * float(expected.abs().max()), 1e-5))


def test_the_launcher_checks_its_arguments() -> None:
    qweight, scales, zeros, _ = _operands(64, 32, 4, 32, False, seed=1)
    x = randn(2, 64, dtype=torch.float16, seed=2)
    with pytest.raises(ValueError, match="qweight must be int32 \\[K / 8, N\\]"):
        w4a16_matmul(x, qweight[:4], scales, zeros, None, 4, 32)
    with pytest.raises(ValueError, match="scales must have ceil\\(K / group_size\\) = 4 rows"):
        w4a16_matmul(x, qweight, scales, zeros, None, 4, 16)
    with pytest.raises(ValueError, match="zeros must be like scales"):
        w4a16_matmul(x, qweight, scales, zeros.float(), None, 4, 32)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        w4a16_matmul(x, qweight, scales, zeros, None, 3, 32)


def test_a_layers_triton_product_equals_its_reference_product() -> None:
    """`Int4LinearMethod` through the kernel (as on a GPU) and through the torch reference on one packed layer:
    leading dims kept, the bias added once."""
    from asyncllm.models.int4_checkpoint import Int4LinearMethod
    from asyncllm.models.layers import TensorParallel
    from asyncllm.models.linear import ColumnParallelLinear

    with torch.device(DEVICE):
        layer = ColumnParallelLinear(96, 40, bias=True, tp=TensorParallel(), dtype=torch.float32)
    layer.bias.data.copy_(randn(40, dtype=torch.float32, seed=4))
    del layer.weight
    for name, t in zip(("qweight", "scales", "zeros", "g_idx"), _operands(96, 40, 4, 32, True, seed=5)):
        layer.register_buffer(name, t)
    x = randn(3, 5, 96, dtype=torch.float32, seed=6)
    out = Int4LinearMethod(4, 32, use_triton=True).apply(layer, x, layer.bias)
    expected = Int4LinearMethod(4, 32, use_triton=False).apply(layer, x, layer.bias)
    assert out.shape == (3, 5, 40)
    assert_close(out, expected, (1e-5 * float(expected.abs().max()), 1e-5))
