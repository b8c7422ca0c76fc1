"""The fused-MoE kernels' tile and activation helpers (`@triton.jit`, called by `fused_moe`'s kernels).

A row block's expert and pairs; activations on float32 products, rounded op by op as the reference's torch ops
round; the bias addition; the tile product (plain, block-fp8's scaled, or W8A8 int8's summed in int32 over all of K
and scaled once, `int8_scaled`); and the weight tiles of quantized experts kept packed, dequantized in float32 and
rounded to the activations' dtype: `int_tile` (AWQ / GPTQ, `reference.IntExperts`) and `mxfp4_tile` (gpt-oss's
MXFP4, `reference.Mxfp4Experts`: exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

from asyncllm.kernels._math import tanh

__all__ = ["block_rows", "silu_mul", "gelu_tanh_mul", "clamped_swiglu", "relu_squared", "plus_bias", "tile_product",
           "int8_scaled", "int_tile", "mxfp4_tile", "packed_tile"]


@triton.jit
def block_rows(sorted_pairs_ptr, block_experts_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """Row block ``pid_m``: its expert, its rows' pair indices (int64), and which rows are pairs (not padding)."""
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pairs, pairs < num_pairs


@triton.jit
def silu_mul(gate, up, dtype):
    """``silu(gate) * up`` for float32 products, rounded as `silu_and_mul` on their dtype roundings."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def gelu_tanh_mul(gate, up, dtype):
    """``gelu_tanh(gate) * up`` for float32 products, rounded as `gelu_tanh_and_mul` on their dtype roundings."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    return (act.to(dtype).to(tl.float32) * up).to(dtype)


@triton.jit
def clamped_swiglu(gate, up, alpha, limit, dtype):
    """`reference.clamped_swiglu` of float32 values already in ``dtype``, each op rounded to ``dtype`` as torch's."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    scaled = (gate * alpha).to(dtype).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
    glu = (gate * sig).to(dtype).to(tl.float32)
    return ((up + 1.0).to(dtype).to(tl.float32) * glu).to(dtype)


@triton.jit
def relu_squared(up, dtype):
    """``relu(up) ** 2`` of float32 values already in ``dtype``, rounded to ``dtype``."""
    up = tl.maximum(up, 0.0)
    return (up * up).to(dtype)


@triton.jit
def plus_bias(product, bias_ptr, mask, HAS_BIAS: tl.constexpr, dtype):
    """A float32 product rounded to ``dtype``, plus (when ``HAS_BIAS``) its row-broadcast bias, rounded again."""
    out = product.to(dtype).to(tl.float32)
    if HAS_BIAS:
        out = (out + tl.load(bias_ptr, mask=mask, other=0.0).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    return out


@triton.jit
def tile_product(acc, a, b, a_s_ptrs, b_s_ptrs, row_mask, n_mask,
             DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, INT8: tl.constexpr):
    """``acc + a @ b``; with ``FP8`` the fp8 tile product in float32 scaled by the rows' group scales and the columns'
    block scales (``*_s_ptrs``: this K group's); with ``INT8`` (W8A8 int8 experts) the int8 tile product added to the
    int32 ``acc`` unscaled, exactly (`int8_scaled` scales the whole sum once)."""
    if INT8:
        if UPCAST:  # K steps under 32 columns: float32, exact (a step's sum is at most 32 * 128 * 128 < 2**24)
            return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee").to(tl.int32)
        else:
            return tl.dot(a, b, acc, out_dtype=tl.int32)  # Triton 3.6 assumes float32 without it and refuses acc
    elif FP8:
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        a_s = tl.load(a_s_ptrs, mask=row_mask, other=0.0)
        b_s = tl.load(b_s_ptrs, mask=n_mask, other=0.0)
        return acc + part * a_s[:, None] * b_s[None, :]
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def int8_scaled(acc, a_s_ptrs, b_s_ptrs, row_mask, n_mask):
    """W8A8 int8 experts' exact int32 sums over all of K in float32, times each row's token scale, times each
    column's weight scale (per row or per matrix), as the dense int8 layers scale ``torch._int_mm``'s."""
    a_s = tl.load(a_s_ptrs, mask=row_mask, other=0.0)
    b_s = tl.load(b_s_ptrs, mask=n_mask, other=0.0)
    return acc.to(tl.float32) * a_s[:, None] * b_s[None, :]


@triton.jit
def int_tile(q_rows, s_rows, z_rows, g_row, k0, offs_k, k_mask, mask, n_mask, BITS: tl.constexpr,
              GROUP_K: tl.constexpr, G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, dtype):
    """``[BLOCK_K, BLOCK_N]`` weights of packed integer experts (`reference.IntExperts`): output rows ``n`` (``*_rows``
    point at each row: ``[1, BLOCK_N]``) at inputs ``k0 + offs_k``, dequantized in float32, rounded to ``dtype``.
    With ``G_IDX`` (GPTQ act-order) input ``k``'s group is ``g_row[k]`` (the expert's ``g_idx`` row), its scales and
    zero points gathered per input; else it is ``k // GROUP_K``, and when a K step lies inside one group (``BLOCK_K``
    divides ``GROUP_K``) one row of scales and zero points is loaded per step instead of one per input."""
    PACK: tl.constexpr = 32 // BITS
    k = k0 + offs_k
    packed = tl.load(q_rows + (k // PACK)[:, None], mask=mask, other=0)
    q = ((packed >> ((k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
    if G_IDX:
        groups = tl.load(g_row + k, mask=k_mask, other=0)[:, None]
        scale = tl.load(s_rows + groups, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_rows + groups, mask=mask, other=0.0).to(tl.float32)
    elif GROUP_K % BLOCK_K == 0:
        group = k0 // GROUP_K
        scale = tl.load(s_rows + group, mask=n_mask[None, :], other=0.0).to(tl.float32)
        zero = tl.load(z_rows + group, mask=n_mask[None, :], other=0.0).to(tl.float32)
    else:
        groups = (k // GROUP_K)[:, None]
        scale = tl.load(s_rows + groups, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_rows + groups, mask=mask, other=0.0).to(tl.float32)
    return ((q - zero) * scale).to(dtype)


@triton.jit
def mxfp4_tile(w_rows, s_rows, k0, offs_k, mask, n_mask, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr, dtype):
    """``[BLOCK_K, BLOCK_N]`` weights of MXFP4 experts (`reference.Mxfp4Experts`): output rows ``n`` (``*_rows`` point
    at each row's bytes and scales: ``[1, BLOCK_N]``) at inputs ``k0 + offs_k``, each e2m1 nibble (the low one first)
    decoded and scaled by its group's ``2 ** (scale - 127)`` in float32, exactly, then rounded to ``dtype``. A K step
    inside one group of ``GROUP_K`` (32) loads one row of scales, a wider one a scale per input."""
    k = k0 + offs_k
    packed = tl.load(w_rows + (k // 2)[:, None], mask=mask, other=0).to(tl.int32)
    nibble = (packed >> ((k % 2) * 4)[:, None]) & 0xF
    exponent = (nibble >> 1) & 3
    mantissa = nibble & 1
    twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << (tl.maximum(exponent, 1) - 1))  # 0 1 2 3 4 6 8 12
    value = twice.to(tl.float32) * 0.5
    # the sign nibble bit or-ed in as float32's sign bit, not negated: Triton 3.6 compiles -x as 0.0 - x (+0.0 for 0.0)
    value = (value.to(tl.uint32, bitcast=True) | ((nibble & 8).to(tl.uint32) << 28)).to(tl.float32, bitcast=True)
    if GROUP_K % BLOCK_K == 0:
        scale = tl.load(s_rows + k0 // GROUP_K, mask=n_mask[None, :], other=0).to(tl.int32)
    else:
        scale = tl.load(s_rows + (k // GROUP_K)[:, None], mask=mask, other=0).to(tl.int32)
    # 2 ** (scale - 127) from its float32 bits; scale 0 is the subnormal 2 ** -127 (bit 22)
    scale = tl.where(scale == 0, 1 << 22, scale << 23).to(tl.float32, bitcast=True)
    return (value * scale).to(dtype)


@triton.jit
def packed_tile(q_rows, s_rows, z_rows, g_row, k0, offs_k, k_mask, mask, n_mask, INT_BITS: tl.constexpr,
                 MXFP4: tl.constexpr, GROUP_K: tl.constexpr, G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, dtype):
    """The weight tile of packed experts: MXFP4's (``MXFP4``), else integer experts' of ``INT_BITS`` (``G_IDX``:
    act-order groups from ``g_row``)."""
    if MXFP4:
        return mxfp4_tile(q_rows, s_rows, k0, offs_k, mask, n_mask, GROUP_K, BLOCK_K, dtype)
    else:
        return int_tile(q_rows, s_rows, z_rows, g_row, k0, offs_k, k_mask, mask, n_mask, INT_BITS, GROUP_K, G_IDX,
                         BLOCK_K, dtype)
