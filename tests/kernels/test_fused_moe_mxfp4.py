"""MXFP4 experts (gpt-oss's checkpoints) kept packed: `reference.fused_moe(mxfp4=...)` is the float path on the
dequantized weights to the bit, and the Triton kernels' tiles dequantize exactly, so the kernels match it as the
float path does."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from asyncllm.kernels import reference
from asyncllm.kernels.fused_moe import fused_moe
from asyncllm.kernels.fused_moe_tiles import mxfp4_tile
from asyncllm.models.mxfp4 import dequantize_mxfp4
from kernel_testing import DEVICE, DTYPES, INTERPRETED, assert_close, randn, requires_gpu
from test_fused_moe_kernel import MOE_TOL

H, I, E, K = 64, 96, 4, 2  # two and three groups of 32 along the products' inputs
GPT_OSS_SWIGLU = reference.ClampedSwiglu(alpha=1.702, limit=7.0)


def _packed(rows: int, cols: int, scales: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, rows, cols / 2]`` random bytes (every nibble, both zeros) and ``[E, rows, cols / 32]`` scales drawn from
    ``scales`` (a half-open range of e8m0 exponents)."""
    blocks = torch.randint(0, 256, (E, rows, cols // 2), generator=gen, dtype=torch.uint8)
    exponents = torch.randint(*scales, (E, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks.to(DEVICE), exponents.to(DEVICE)


def _mxfp4_experts(seed: int, gated: bool = True) -> tuple[torch.Tensor, torch.Tensor, reference.Mxfp4Experts]:
    """w13 over scales 2**-9 .. 2**3 (the hidden states scaled down to match: gate and up of a few units, so gpt-oss's
    clamp at 7 bites now and then), w2 over 2**-21 .. 2**-9: outputs of order 1."""
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = _packed((2 if gated else 1) * I, H, (118, 131), gen)
    w2, s2 = _packed(H, I, (106, 119), gen)
    return w13, w2, reference.Mxfp4Experts(s13, s2)


def _dequantized(w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_mxfp4(w.view(*w.shape[:2], -1, 16), scales, dtype)


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 of E experts per token, about a quarter of the ids -1 (another rank's expert)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    ids = torch.where(torch.rand(tokens, K, generator=gen) < 0.25, -1, ids)
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def _gpt_oss_inputs(tokens: int, dtype: torch.dtype, seed: int) -> tuple:
    hidden = randn(tokens, H, dtype=dtype, seed=seed, scale=1 / 16)
    w13_bias = randn(E, 2 * I, dtype=dtype, seed=seed + 1, scale=0.5)
    w2_bias = randn(E, H, dtype=dtype, seed=seed + 2, scale=0.5)
    return hidden, w13_bias, w2_bias, *_routing(tokens, seed + 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_float_path_on_dequantized_weights(dtype: torch.dtype) -> None:
    """Bit for bit, with gpt-oss's biases and clamped SwiGLU, other ranks' ids and a LoRA addition."""
    w13, w2, mxfp4 = _mxfp4_experts(seed=0)
    hidden, w13_bias, w2_bias, topk_weights, topk_ids = _gpt_oss_inputs(9, dtype, seed=1)
    dense13, dense2 = _dequantized(w13, mxfp4.w13_scales, dtype), _dequantized(w2, mxfp4.w2_scales, dtype)

    def lora(which: int, expert: int, token_idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (x[:, :H] if which else torch.cat([x, x.flip(-1), x], dim=-1)) * (expert + 1) / 64

    args = (topk_weights, topk_ids, w13_bias, w2_bias, GPT_OSS_SWIGLU)
    expected = reference.fused_moe(hidden, dense13, dense2, *args, lora=lora)
    out = reference.fused_moe(hidden, w13, w2, *args, mxfp4=mxfp4, lora=lora)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert 0.1 < expected.abs().max() < 100 and (expected[(topk_ids < 0).all(dim=1)] == 0).all()
    unclamped = args[:4] + (GPT_OSS_SWIGLU._replace(limit=float("inf")),)
    assert not torch.equal(expected, reference.fused_moe(hidden, dense13, dense2, *unclamped, lora=lora))  # clamped


@triton.jit
def _tile_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out [N, K]``: `mxfp4_tile` of rows ``[N, K / 2]`` and their scales ``[N, K / 32]``, step by step."""
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[None, :]
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        mask = (offs_k < K - k0)[:, None] & n_mask[None, :]
        tile = mxfp4_tile(w_ptr + rows * (K // 2), s_ptr + rows * (K // 32), k0, offs_k, mask, n_mask, 32, BLOCK_K,
                          out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows * K + (k0 + offs_k)[:, None], tile, mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_k", [16, 64])  # the interpreter's step (a row of scales), the GPU's (two groups)
def test_kernel_tiles_are_the_dequantized_weights(dtype: torch.dtype, block_k: int) -> None:
    """Every byte value under every scale from 0 (2**-127, a float32 subnormal) to 252 (6 * 2**125: above, 6 times
    the scale overflows), exactly. The interpreter's bfloat16 casts mishandle subnormal results: from scale 2 there."""
    rows, cols = 24, 352  # 264 groups of 32; rows below the 32 of a block (masked), 11 groups a row
    low = 2 if INTERPRETED and dtype == torch.bfloat16 else 0
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randperm(rows * cols // 2, generator=gen).remainder(256).to(torch.uint8).view(rows, cols // 2)
    scales = (low + torch.arange(rows * cols // 32).remainder(253 - low)).to(torch.uint8).view(rows, cols // 32)
    blocks, scales = blocks.to(DEVICE), scales.to(DEVICE)
    out = torch.full((rows, cols), float("nan"), dtype=dtype, device=DEVICE)
    _tile_kernel[(1,)](blocks, scales, out, rows, cols, BLOCK_N=32, BLOCK_K=block_k)
    expected = dequantize_mxfp4(blocks.view(rows, -1, 16), scales, dtype)
    assert torch.equal(out, expected) and torch.equal(out.signbit(), expected.signbit())  # -0.0 where it belongs
    assert expected.abs().max() == 6 * 2.0**125 and expected.abs()[expected != 0].min() == 2.0 ** (low - 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 13])
def test_kernel_matches_reference(dtype: torch.dtype, tokens: int) -> None:
    """gpt-oss's experts: biases, the clamped SwiGLU, top 2 of 4, other ranks' ids, H 64 and I 96."""
    w13, w2, mxfp4 = _mxfp4_experts(seed=2)
    hidden, w13_bias, w2_bias, topk_weights, topk_ids = _gpt_oss_inputs(tokens, dtype, seed=3)
    args = (topk_weights, topk_ids, w13_bias, w2_bias, GPT_OSS_SWIGLU)
    expected = reference.fused_moe(hidden, w13, w2, *args, mxfp4=mxfp4)
    out = fused_moe(hidden, w13, w2, *args, mxfp4=mxfp4)
    assert out.shape == (tokens, H) and out.dtype == dtype
    if tokens > 1:  # gate and up past the limit for some pairs
        unclamped = args[:4] + (GPT_OSS_SWIGLU._replace(limit=float("inf")),)
        assert not torch.equal(expected, reference.fused_moe(hidden, w13, w2, *unclamped, mxfp4=mxfp4))
    assert_close(out, expected, MOE_TOL[dtype])


def test_experts_without_a_gate() -> None:
    """Not gpt-oss's layout, but the switch is the tile's: w13 the up rows alone, ``relu(up) ** 2``."""
    w13, w2, mxfp4 = _mxfp4_experts(seed=4, gated=False)
    hidden, _, _, topk_weights, topk_ids = _gpt_oss_inputs(7, torch.float32, seed=5)
    expected = reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation="relu2", mxfp4=mxfp4)
    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation="relu2", mxfp4=mxfp4)
    assert_close(out, expected, MOE_TOL[torch.float32])


def test_arguments_are_checked() -> None:
    w13, w2, mxfp4 = _mxfp4_experts(seed=6)
    hidden, _, _, topk_weights, topk_ids = _gpt_oss_inputs(3, torch.float32, seed=7)
    bad = {
        r"mxfp4: hidden's size H \(48\) must be a multiple of 32": dict(hidden=hidden[:, :48].contiguous(),
                                                                        w13=w13[:, :, :24], w2=w2[:, :48]),
        r"mxfp4: w13's intermediate size I \(48\) must be a multiple of 32": dict(
            w13=torch.cat([w13[:, :48], w13[:, I:I + 48]], dim=1), w2=w2[:, :, :24].contiguous()),
        r"w13 must be \[E, 2I, 32\] of torch.uint8": dict(w13=w13.to(torch.int32)),
        r"w2 must be \[4, 64, 48\] of torch.uint8": dict(w2=w2[:, :, :40]),
        r"mxfp4.w13_scales must be uint8 \[4, 192, 2\]": dict(mxfp4=mxfp4._replace(w13_scales=mxfp4.w13_scales.int())),
        r"mxfp4.w2_scales must be uint8 \[4, 64, 3\]": dict(mxfp4=mxfp4._replace(w2_scales=mxfp4.w2_scales[:, :, :2])),
        r"mxfp4.w2_scales must be .*last dim contiguous": dict(
            mxfp4=mxfp4._replace(w2_scales=mxfp4.w2_scales.transpose(1, 2).contiguous().transpose(1, 2))),
        "one at most": dict(int_experts=reference.IntExperts(*mxfp4, *mxfp4, 4, 32)),
    }
    for message, change in bad.items():
        args = dict(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, mxfp4=mxfp4) | change
        with pytest.raises(ValueError, match=message):
            fused_moe(**args)
    with pytest.raises(ValueError, match="one at most"):
        reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, mxfp4=mxfp4,
                            int_experts=reference.IntExperts(*mxfp4, *mxfp4, 4, 32))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("inter", [2880, 1440])
@pytest.mark.parametrize("tokens", [1, 256])
def test_gpt_oss_20b_shapes_on_the_gpu(tokens: int, inter: int) -> None:
    """gpt-oss-20b's experts (H 2880, 32 experts, top 4; I 2880, or 1440: a rank of two, whose down product's last
    64-wide K step is half masked) in bfloat16, under torch's sync check: against the reference, and equal, bit for
    bit, to the kernel's float path on the dequantized weights (the tiles decode to exactly those values)."""
    hidden_size = 2880
    experts, k, dtype = 32, 4, torch.bfloat16
    gen = torch.Generator().manual_seed(21)

    def packed(rows: int, cols: int, scales: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
        return blocks.to(DEVICE), torch.randint(*scales, (experts, rows, cols // 32), generator=gen,
                                                dtype=torch.uint8).to(DEVICE)

    (w13, s13), (w2, s2) = packed(2 * inter, hidden_size, (118, 122)), packed(hidden_size, inter, (116, 120))
    hidden = randn(tokens, hidden_size, dtype=dtype, seed=22)
    biases = randn(experts, 2 * inter, dtype=dtype, seed=23, scale=0.1), randn(experts, hidden_size, dtype=dtype,
                                                                                 seed=24, scale=0.1)
    topk_weights, topk_ids = torch.softmax(randn(tokens, experts, dtype=torch.float32, seed=25), -1).topk(k, dim=-1)
    args = (topk_weights, topk_ids, *biases, GPT_OSS_SWIGLU)
    mxfp4 = reference.Mxfp4Experts(s13, s2)
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        out = fused_moe(hidden, w13, w2, *args, mxfp4=mxfp4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(out, reference.fused_moe(hidden, w13, w2, *args, mxfp4=mxfp4), MOE_TOL[dtype])
    floats = _dequantized(w13, s13, dtype), _dequantized(w2, s2, dtype)
    assert torch.equal(out, fused_moe(hidden, *floats, *args))
