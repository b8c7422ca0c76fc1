"""kernels/block_fp8.py against kernels/reference.py: the per-token-group fp8 quantizer and the block-scaled
fp8 GEMM (pre-quantized fp8 checkpoints), at small odd shapes: one row, K not a multiple of the group, N not
a multiple of the weight block, a group size that is no power of two.

Tolerances: the quantizer must equal the reference bit for bit (IEEE divisions, nearest-even rounding). The
GEMM's fp8 products are exact in float32, so float32 output differs from the reference (dequantize, then one
float32 matmul) only by the order of float32 sums and of the scale multiplications: 1e-5 relative to the
output's largest magnitude (interpreted). On a GPU the fp8 tensor cores sum each group's products with fewer
bits than float32 (about 14 on Hopper: why DeepGEMM promotes the partial sums to float32 every 128 products;
an H200 measured 2.8e-4 of the largest magnitude), so the bound there is 2^-9 of it: 32 times the 2^-14 the
tensor cores keep, 7 times the measurement. The kernel already promotes at each group (one ``tl.dot`` per
group, scaled and added to a float32 accumulator), so the error is inside one group's dot: at the real 128-wide
group four chained sm_90 wgmma steps of 32 products, since Triton's default ``max_num_imprecise_acc`` on sm_90
(2^30) never promotes inside a dot. float16 output adds one rounding of the result: 2 units in the last place.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.block_fp8 import per_token_group_quant_fp8, static_quant_fp8, w8a8_block_fp8_matmul
from kernel_testing import DEVICE, ELEMENTWISE_TOL, assert_close, randn

FP8 = torch.float8_e4m3fn
FP32_BOUND = 2.0**-9 if DEVICE.type == "cuda" else 1e-5  # of the largest magnitude (module doc)


def _fp32_tol(expected: torch.Tensor) -> tuple[float, float]:
    return FP32_BOUND * float(expected.abs().max()), FP32_BOUND


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows, k, group", [(1, 72, 32), (7, 200, 128), (5, 100, 48), (3, 16, 16)])
def test_group_quant_equals_the_reference_bit_for_bit(dtype: torch.dtype, rows: int, k: int, group: int) -> None:
    x = randn(rows, k, dtype=dtype, seed=rows + k, scale=3.0)
    x[0, : min(group, k)] = 0.0  # an all-zero group: zeros and the floor scale, not NaN
    if rows > 1:
        x[1, 0] = 1000.0  # one outlier: its group's other values fall into e4m3's subnormals
    q, scale = per_token_group_quant_fp8(x, group)
    ref_q, ref_scale = reference.per_token_group_quant_fp8(x.cpu(), group)
    assert q.dtype == FP8 and scale.shape == (rows, -(-k // group))
    assert torch.equal(_bits(q), _bits(ref_q))
    assert torch.equal(scale.cpu(), ref_scale)
    assert float(ref_scale[0, 0]) == float(torch.tensor(reference.FP8_MIN_SCALE)) and not _bits(ref_q)[0, 0].any()
    for g in range(1, scale.shape[1]):  # every other group's largest value maps to exactly 448
        assert bool((ref_q[:, g * group:(g + 1) * group].float().abs().amax(-1) == 448.0).all())


STATIC_SCALE = 3 / 448 * 1.75
"""No power of two: ``x / s`` rounds, and `DIVIDED` tells a division from a multiplication by ``1 / s``."""
DIVIDED = (1.7812498807907104, 113)
"""(x, fp8 bits of ``x / STATIC_SCALE``): ``x * (1 / STATIC_SCALE)`` rounds to 114 (vLLM's arithmetic)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, k", [(1, 72), (5, 17), (3, 2500)])
def test_static_quant_equals_the_reference_bit_for_bit(dtype: torch.dtype, rows: int, k: int) -> None:
    """A static scale: -0.0 (0x80), saturating values (+-448: 0x7E, 0xFE), one in e4m3's subnormals, K past a
    column tile (`block_fp8.STATIC_BLOCK`), rows strided wider than K."""
    x = randn(rows, k + 3, dtype=dtype, seed=rows + k, scale=4.0)[:, :k]
    x[0, :4] = torch.tensor([-0.0, 1e4, -1e4, 1e-4])
    if dtype == torch.float32:
        x[0, 4] = DIVIDED[0]
    scale = torch.tensor(STATIC_SCALE, device=DEVICE)
    q, s = static_quant_fp8(x, scale)
    ref_q, ref_s = reference.static_quant_fp8(x.cpu(), scale.cpu())
    assert q.dtype == FP8 and s.shape == (rows, 1)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(s.cpu(), ref_s) and bool((ref_s == scale.cpu()).all())
    assert _bits(ref_q)[0, :3].tolist() == [0x80, 0x7E, 0xFE] and 0 < _bits(ref_q)[0, 3] < 8
    assert dtype != torch.float32 or int(_bits(ref_q)[0, 4]) == DIVIDED[1]


def test_the_static_quant_micro_benchmark_times_kernel_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncllm bench kernels`' static fp8 quantizer rows on a tiny shape (each call run once, not timed)."""
    from asyncllm.bench import kernels as bench

    calls = []
    monkeypatch.setattr(bench, "time_ms", lambda fn: calls.append(fn()) or 0.001)
    rows = bench._static_fp8_quant({"hidden_size": 24, "intermediate_size": 40}, torch.float32, 1e12,
                                   device=str(DEVICE), token_counts=(1, 3))
    assert [r["shape"] for r in rows] == ["1x24", "3x24", "1x40", "3x40"] and len(calls) == 8
    for (q, scale), (ref_q, ref_scale) in zip(calls[0::2], calls[1::2]):
        assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(scale.cpu(), ref_scale.cpu())


def _operands(m: int, n: int, k: int, block: tuple[int, int], seed: int):
    a_q, a_s = reference.per_token_group_quant_fp8(randn(m, k, dtype=torch.float32, seed=seed).cpu(), block[1])
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1))
    b_s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=torch.Generator().manual_seed(seed + 2)) / 448
    b_q = (w * 100).clamp(-448, 448).to(FP8)
    return [t.to(DEVICE) for t in (a_q, a_s, b_q, b_s + 1e-4)]


SHAPES = [  # m, n, k, (bn, bk)
    (1, 48, 72, (16, 32)),  # one row; K past the last full group
    (19, 96, 200, (32, 64)),
    (33, 40, 130, (128, 128)),  # the real block size: N and K inside one block, K's tail in a second
    (4, 30, 64, (16, 48)),  # a group size that is no power of two; N past the last full block
]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m, n, k, block", SHAPES)
def test_block_fp8_matmul_equals_the_reference(m: int, n: int, k: int, block: tuple[int, int],
                                               out_dtype: torch.dtype) -> None:
    a_q, a_s, b_q, b_s = _operands(m, n, k, block, seed=m + n)
    out = w8a8_block_fp8_matmul(a_q, a_s, b_q, b_s, block, out_dtype)
    expected = reference.w8a8_block_fp8_matmul(*(t.cpu() for t in (a_q, a_s, b_q, b_s)), block, torch.float32)
    assert out.shape == (m, n) and out.dtype == out_dtype
    if out_dtype == torch.float32:
        assert_close(out, expected, _fp32_tol(expected))
    else:
        assert_close(out, expected.to(out_dtype), ELEMENTWISE_TOL[torch.float16])


def test_a_strided_activation_and_the_scales_of_each_block_column() -> None:
    """Rows of a wider buffer (row stride > K); every weight block scaled apart: zeroing one block's scale
    zeroes exactly that block's share of the output."""
    m, n, k, block = 5, 64, 96, (32, 32)
    a_q, a_s, b_q, b_s = _operands(m, n, k, block, seed=3)
    wide = torch.zeros(m, k + 8, dtype=FP8, device=DEVICE)
    wide[:, :k] = a_q
    b_s[1, 2] = 0.0
    out = w8a8_block_fp8_matmul(wide[:, :k], a_s, b_q, b_s, block, torch.float32)
    expected = reference.w8a8_block_fp8_matmul(*(t.cpu() for t in (a_q, a_s, b_q, b_s)), block, torch.float32)
    assert_close(out, expected, _fp32_tol(expected))


def test_the_launchers_check_their_arguments() -> None:
    a_q, a_s, b_q, b_s = _operands(2, 32, 64, (16, 32), seed=1)
    with pytest.raises(ValueError, match="b_s must be float32 of shape"):
        w8a8_block_fp8_matmul(a_q, a_s, b_q, b_s[:1], (16, 32), torch.float32)
    with pytest.raises(ValueError, match="a_q must be a 2-D float8_e4m3fn"):
        w8a8_block_fp8_matmul(a_q.float(), a_s, b_q, b_s, (16, 32), torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        per_token_group_quant_fp8(randn(4, 8, dtype=torch.float32, seed=0).t(), 4)


def test_a_layers_triton_product_equals_its_dequantize_fallback() -> None:
    """`Fp8BlockLinearMethod` through the kernels (as on an sm_89+ GPU) and through the CPU fallback on one
    layer: leading dims kept, the bias added once; the same function up to float32 summation order."""
    from torch import nn

    from asyncllm.models.fp8_checkpoint import Fp8BlockLinearMethod, quantize_fp8_blocks
    from asyncllm.models.layers import TensorParallel
    from asyncllm.models.linear import ColumnParallelLinear

    block = (16, 32)
    with torch.device(DEVICE):
        layer = ColumnParallelLinear(72, 40, bias=True, tp=TensorParallel(), dtype=torch.float32)
    layer.bias.data.copy_(randn(40, dtype=torch.float32, seed=4))
    w_q, w_s = quantize_fp8_blocks(randn(40, 72, dtype=torch.float32, seed=5), block)
    layer.weight = nn.Parameter(w_q, requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(w_s, requires_grad=False)
    x = randn(3, 5, 72, dtype=torch.float32, seed=6)
    out = Fp8BlockLinearMethod(block, use_triton=True).apply(layer, x, layer.bias)
    expected = Fp8BlockLinearMethod(block, use_triton=False).apply(layer, x, layer.bias)
    assert out.shape == (3, 5, 40)
    assert_close(out, expected, _fp32_tol(expected))
