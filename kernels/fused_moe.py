"""Triton fused mixture-of-experts MLP: two grouped matrix products over tokens sorted by expert.

``fused_moe(hidden, w13, w2, topk_weights, topk_ids)`` computes, for each token, the sum over its k
experts of ``weight * down_e(silu(gate_e x) * up_e x)``, the meaning of `reference.fused_moe`. Three
steps, none of which reads a device value on the host (so a call is CUDA-graph capturable):

1. `align_tokens` (torch ops): the ``T * k`` (token, slot) pairs are sorted by expert (stable, so a
   group keeps token order), each expert's group is padded to a multiple of ``BLOCK_M`` rows, and
   every block of ``BLOCK_M`` rows gets the expert it belongs to. The buffers have their worst-case
   size (``T*k + min(E, T*k) * (BLOCK_M - 1)`` rows) and the padded total stays in a device tensor;
   a pair whose id is outside ``[0, E)`` (an expert another rank holds) is in no group.
2. `_gate_up_kernel`, grid (row blocks, column blocks of I): a program multiplies its block's
   tokens (gathered from ``hidden``) by one column block of its expert's gate rows and the same
   block of its up rows, and stores ``silu(gate) * up`` per pair, rounded as `silu_and_mul` rounds
   after a product in the dtype (SiLU-and-mul fused: no ``[*, 2I]`` buffer, one launch fewer).
3. `_down_kernel`, grid (row blocks, column blocks of H): the down product of each pair's
   activation, rounded to the dtype, times the pair's routing weight in float32, rounded again
   (the reference's rounding), stored at the pair's row of a ``[T, k, H]`` buffer (zeros where a
   pair has no local expert), which a torch ``sum`` over k reduces: deterministic, no atomics.

gpt-oss's experts add two compile-time switches: ``HAS_BIAS`` (an expert's bias added to its gate/up and its
down products, each rounded first as the reference adds it after the product) and ``SWIGLU`` (the clamped
SwiGLU of `reference.ClampedSwiglu` in place of SiLU-and-mul, rounded op by op as the reference's torch ops
round). Nemotron 3's experts have no gate: ``GATED`` off, w13 holds only the up rows and the activation is
``relu(up) ** 2`` (rounded as torch rounds ``square``). Block-fp8 experts (``FP8``, `reference.Fp8Experts`): the
hidden states and the activations are quantized per token in groups of the block's ``bk`` columns
(`block_fp8.per_token_group_quant_fp8`; a group of at least K columns: one scale per token), ``GROUP_K`` is ``bk``,
and each fp8 tile product (float32 accumulation; upcast to float32 under the interpreter, or for K steps under 32
columns) is scaled by its rows' group scales and its columns' block scales (group ``k0 // GROUP_K``) before it is
added. ``BLOCK_K`` is ``bk`` up to 128 columns (one step per scale group, the block checkpoints' 128), else 128
(`FP8_K_STEP`): a wider group (a multiple of 128, or all of K: per-row and per-tensor experts' one scale per row or
block row) spans several steps. Static activation scales (`reference.Fp8Experts`' ``w13_input_scale`` /
``w2_input_scale``) take the same path: each input quantized with its product's one scale by
`block_fp8.static_quant_fp8` (one Triton kernel, bit for bit `reference.static_quant_fp8`), a scales tensor of it
for every token (no new constexpr). W8A8 int8 experts (compressed-tensors' ``*-quantized.w8a8``) take the same path with
int8 weights (``FP8`` and ``INT8`` on): each input quantized to int8 per token in one Triton kernel
(`int8_quant.quantize_int8_per_token`, bit for bit compressed-tensors' `reference.quantize_int8_per_token`), the int8
tile products accumulated in int32 over all of K on int8 tensor cores (numpy's exact int32 ``matmul`` under the
interpreter; K steps under 32 columns upcast to float32, exact at a step's ``32 * 128 * 128 < 2**24``), then scaled
once in float32, ``(sum * token scale) * row scale`` (`fused_moe_tiles.int8_scaled`), as the dense int8 layers scale
``torch._int_mm``'s: exact sums, no float op per K step. The sums fit in int32 for K up to `INT8_MAX_K` (131071:
``128 * 128 * K < 2**31``; the launcher refuses more). Packed experts
dequantize each weight tile in float32, round it to the dtype and multiply (`fused_moe_tiles`; two pipeline stages, one for act-order):
AWQ / GPTQ integers (``INT_BITS``, `reference.IntExperts`) and gpt-oss's MXFP4 (``MXFP4``, `reference.Mxfp4Experts`:
each e2m1 nibble times its group's ``2 ** (scale - 127)`` built from float32 bits, exact, so the float path's result
on the dequantized weights); GPTQ's act-order integer experts (``G_IDX``, `reference.IntExperts`' ``w13_g_idx`` /
``w2_g_idx``) gather each input's scale and zero point at its group ``g_idx[e, k]`` in place of ``k // GROUP_K``.
Off, the kernels compile as before.

Blocks past the padded total return at once (they read the total from the device). Products
accumulate in float32 (``ieee`` dots for float32 inputs, tensor cores for half types), int8 experts' in int32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from asyncllm.kernels.block_fp8 import per_token_group_quant_fp8, static_quant_fp8
from asyncllm.kernels.fused_moe_tiles import (block_rows, clamped_swiglu, gelu_tanh_mul, int8_scaled, packed_tile,
                                               plus_bias, tile_product, relu_squared, silu_mul)
from asyncllm.kernels.fused_moe_checks import FP8_K_STEP, INT8_MAX_K, check_args, check_bias, fp8_k_step
from asyncllm.kernels.int8_quant import quantize_int8_per_token
from asyncllm.kernels.reference import ClampedSwiglu, Fp8Experts, IntExperts, Mxfp4Experts
from asyncllm.models.mxfp4 import MXFP4_GROUP

__all__ = ["Alignment", "FP8_K_STEP", "INT8_MAX_K", "MoeConfig", "align_tokens", "fp8_k_step", "fused_moe",
           "launch_config", "moe_config"]


class MoeConfig(NamedTuple):
    """Block sizes and launch settings of both grouped products."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class Alignment(NamedTuple):
    """The pairs sorted by expert, in padded groups (`align_tokens`)."""

    sorted_pairs: torch.Tensor
    """int32 ``[num_blocks * BLOCK_M]``: pair index ``token * k + slot`` per row; ``T * k`` on padding rows."""
    block_experts: torch.Tensor
    """int32 ``[num_blocks]``: the expert of each block; ``E`` for blocks past the padded total."""
    total_rows: torch.Tensor
    """int64 ``[1]``: the padded row count (a multiple of BLOCK_M), on the device."""


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype, on_gpu: bool) -> MoeConfig:
    """Block sizes: 16-row blocks while an expert gets few rows (decode), 64 once most get many
    (prefill); small blocks on the CPU, where the interpreter runs them (tests: fast, masked tails)."""
    if not on_gpu:
        return MoeConfig(16, 16, 16, 4, 1)
    stages = 2 if dtype == torch.float32 else 3
    if num_pairs < 32 * num_experts:  # fewer than 32 rows per expert on average
        return MoeConfig(16, 64, 64, 4, stages)
    return MoeConfig(64, 128, 64, 8 if dtype != torch.float32 else 4, stages)


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the ``T * k`` pairs of ``topk_ids [T, k]`` by expert into groups padded to ``block_m`` rows.

    Sync-free torch ops at worst-case sizes: counts by ``scatter_add_``, a stable sort, offsets by
    ``cumsum``, each block's expert by ``searchsorted``. Ids outside ``[0, num_experts)`` are dropped."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    rows = num_blocks * block_m
    local = (flat >= 0) & (flat < num_experts)
    keys = torch.where(local, flat, num_experts)  # the other ranks' pairs in one last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    padded = (counts[:num_experts] + (block_m - 1)) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    group_start = counts.cumsum(0) - counts
    sorted_keys, order = torch.sort(keys, stable=True)
    rank = torch.arange(num_pairs, device=device) - group_start[sorted_keys]
    row = padded_start[sorted_keys.clamp(max=num_experts - 1)] + rank
    dest = torch.where(sorted_keys < num_experts, row, rows)  # the other ranks' pairs to row `rows`, dropped
    sorted_pairs = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, dtype=torch.int64, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return Alignment(sorted_pairs[:rows], block_experts.to(torch.int32), padded_end[num_experts - 1:])


@triton.jit(do_not_specialize=["num_pairs"])  # per step: bounds the row mask only
def _gate_up_kernel(
    hidden_ptr, w13_ptr, act_ptr, sorted_pairs_ptr, block_experts_ptr, total_rows_ptr, bias_ptr, a_s_ptr, w_s_ptr,
    w_z_ptr, g_idx_ptr,
    hidden_stride, w13_stride_e, w13_stride_n, act_stride, bias_stride_e, a_s_stride, w_s_stride_e, w_s_stride_n,
    g_idx_stride_e, num_pairs, H, I, alpha, limit,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, GATED: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr, UPCAST: tl.constexpr, GELU_TANH: tl.constexpr,
    INT_BITS: tl.constexpr, GROUP_K: tl.constexpr, MXFP4: tl.constexpr, G_IDX: tl.constexpr, INT8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_rows_ptr):
        return
    dtype = act_ptr.dtype.element_ty
    expert, pairs, row_mask = block_rows(sorted_pairs_ptr, block_experts_ptr, pid_m, num_pairs, BLOCK_M)
    tokens = tl.where(row_mask, pairs // TOP_K, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + tokens[:, None] * hidden_stride + offs_k[None, :]
    gate_ptrs = w13_ptr + expert * w13_stride_e + offs_n.to(tl.int64)[None, :] * w13_stride_n + offs_k[:, None]
    up_ptrs = gate_ptrs + I * w13_stride_n if GATED else gate_ptrs  # without a gate, w13 is the up rows alone
    a_s_ptrs = a_s_ptr + tokens * a_s_stride  # FP8: each row's group scales, each column's block scales
    gate_s_ptrs = w_s_ptr + expert * w_s_stride_e + (offs_n // GROUP_N).to(tl.int64) * w_s_stride_n
    up_rows = offs_n + I if GATED else offs_n
    up_s_ptrs = w_s_ptr + expert * w_s_stride_e + (up_rows // GROUP_N).to(tl.int64) * w_s_stride_n
    acc_dtype = tl.int32 if INT8 else tl.float32  # INT8: exact int32 sums over all of K, scaled after the loop
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_dtype)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_dtype)
    rows = offs_n.to(tl.int64)[None, :]  # INT_BITS / MXFP4: each output row's packed values, scales (and zeros)
    gate_q = w13_ptr + expert * w13_stride_e + rows * w13_stride_n
    gate_sz = expert * w_s_stride_e + rows * w_s_stride_n
    up_q = gate_q + I * w13_stride_n if GATED else gate_q
    up_sz = gate_sz + I * w_s_stride_n if GATED else gate_sz
    g_row = g_idx_ptr + expert * g_idx_stride_e  # G_IDX: the expert's input groups (gate and up share them)
    for k0 in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        group = k0 // GROUP_K
        if INT_BITS or MXFP4:
            if GATED:
                gate = packed_tile(gate_q, w_s_ptr + gate_sz, w_z_ptr + gate_sz, g_row, k0, offs_k, k_mask, w_mask,
                                    n_mask, INT_BITS, MXFP4, GROUP_K, G_IDX, BLOCK_K, dtype)
                acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
            up = packed_tile(up_q, w_s_ptr + up_sz, w_z_ptr + up_sz, g_row, k0, offs_k, k_mask, w_mask, n_mask,
                              INT_BITS, MXFP4, GROUP_K, G_IDX, BLOCK_K, dtype)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        else:
            if GATED:
                gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
                acc_gate = tile_product(acc_gate, a, gate, a_s_ptrs + group, gate_s_ptrs + group, row_mask, n_mask,
                                        DOT_PRECISION, FP8, UPCAST, INT8)
            up = tl.load(up_ptrs, mask=w_mask, other=0.0)
            acc_up = tile_product(acc_up, a, up, a_s_ptrs + group, up_s_ptrs + group, row_mask, n_mask,
                                  DOT_PRECISION, FP8, UPCAST, INT8)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if INT8:  # one scale group (all of K): the token's scale and each row's
        if GATED:
            acc_gate = int8_scaled(acc_gate, a_s_ptrs, gate_s_ptrs, row_mask, n_mask)
        acc_up = int8_scaled(acc_up, a_s_ptrs, up_s_ptrs, row_mask, n_mask)
    gate_bias_ptrs = bias_ptr + expert * bias_stride_e + offs_n
    if GATED:
        gate = plus_bias(acc_gate, gate_bias_ptrs, n_mask, HAS_BIAS, dtype)
        up = plus_bias(acc_up, gate_bias_ptrs + I, n_mask, HAS_BIAS, dtype)
        if SWIGLU:
            act = clamped_swiglu(gate, up, alpha, limit, dtype)
        elif GELU_TANH:
            act = gelu_tanh_mul(gate, up, dtype)
        else:
            act = silu_mul(gate, up, dtype)
    else:
        act = relu_squared(plus_bias(acc_up, gate_bias_ptrs, n_mask, HAS_BIAS, dtype), dtype)
    out_ptrs = act_ptr + pairs[:, None] * act_stride + offs_n[None, :]
    tl.store(out_ptrs, act, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # per step: bounds the row mask only
def _down_kernel(
    act_ptr, w2_ptr, out_ptr, topk_weights_ptr, sorted_pairs_ptr, block_experts_ptr, total_rows_ptr, bias_ptr,
    a_s_ptr, w_s_ptr, w_z_ptr, g_idx_ptr,
    act_stride, w2_stride_e, w2_stride_n, out_stride, bias_stride_e, a_s_stride, w_s_stride_e, w_s_stride_n,
    g_idx_stride_e, num_pairs, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, FP8: tl.constexpr, GROUP_N: tl.constexpr, UPCAST: tl.constexpr,
    INT_BITS: tl.constexpr, GROUP_K: tl.constexpr, MXFP4: tl.constexpr, G_IDX: tl.constexpr, INT8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_rows_ptr):
        return
    dtype = out_ptr.dtype.element_ty
    expert, pairs, row_mask = block_rows(sorted_pairs_ptr, block_experts_ptr, pid_m, num_pairs, BLOCK_M)
    pairs = tl.where(row_mask, pairs, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pairs[:, None] * act_stride + offs_k[None, :]
    w_ptrs = w2_ptr + expert * w2_stride_e + offs_n.to(tl.int64)[None, :] * w2_stride_n + offs_k[:, None]
    a_s_ptrs = a_s_ptr + pairs * a_s_stride
    w_s_ptrs = w_s_ptr + expert * w_s_stride_e + (offs_n // GROUP_N).to(tl.int64) * w_s_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if INT8 else tl.float32)
    rows = offs_n.to(tl.int64)[None, :]  # INT_BITS / MXFP4: each output row's packed values, scales (and zeros)
    w_q = w2_ptr + expert * w2_stride_e + rows * w2_stride_n
    w_sz = expert * w_s_stride_e + rows * w_s_stride_n
    g_row = g_idx_ptr + expert * g_idx_stride_e  # G_IDX: the expert's input groups
    for k0 in range(0, I, BLOCK_K):
        k_mask = offs_k < I - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if INT_BITS or MXFP4:
            w = packed_tile(w_q, w_s_ptr + w_sz, w_z_ptr + w_sz, g_row, k0, offs_k, k_mask,
                             k_mask[:, None] & n_mask[None, :], n_mask, INT_BITS, MXFP4, GROUP_K, G_IDX, BLOCK_K, dtype)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        else:
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            group = k0 // GROUP_K
            acc = tile_product(acc, a, w, a_s_ptrs + group, w_s_ptrs + group, row_mask, n_mask, DOT_PRECISION, FP8,
                               UPCAST, INT8)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if INT8:
        acc = int8_scaled(acc, a_s_ptrs, w_s_ptrs, row_mask, n_mask)
    weight = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)
    down = plus_bias(acc, bias_ptr + expert * bias_stride_e + offs_n, n_mask, HAS_BIAS, dtype)
    out = (down * weight[:, None]).to(dtype)
    tl.store(out_ptr + pairs[:, None] * out_stride + offs_n[None, :], out, mask=row_mask[:, None] & n_mask[None, :])


def launch_config(num_pairs: int, num_experts: int, dtype: torch.dtype, on_gpu: bool, fp8_group: int | None = None,
                  packed: bool = False, act_order: bool = False) -> MoeConfig:
    """`moe_config`'s blocks as `fused_moe` launches them (the sm_90 compile check compiles these): fp8 experts' K
    step inside their scale groups (``fp8_group``, `fp8_k_step`); packed experts' (integer, MXFP4) dequantized tiles
    take registers and shared memory: at most two stages; act-order's gathered scale and zero tiles kept out of a
    pipeline's shared memory: 64 columns, one stage (two stages took 106-112 KiB: over sm_86 / sm_89's 99 KiB)."""
    cfg = moe_config(num_pairs, num_experts, dtype, on_gpu)
    if fp8_group is not None:
        cfg = cfg._replace(block_k=fp8_k_step(fp8_group))
    if packed:
        cfg = cfg._replace(num_stages=min(cfg.num_stages, 2))
    if act_order:
        cfg = cfg._replace(block_n=min(cfg.block_n, 64), num_stages=1)
    return cfg


def fused_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None, swiglu: ClampedSwiglu | None = None,
    activation: str = "silu", fp8: Fp8Experts | None = None, int_experts: IntExperts | None = None,
    mxfp4: Mxfp4Experts | None = None,
) -> torch.Tensor:
    """hidden ``[T, H]``, w13 ``[E, 2I, H]`` (gate rows, then up rows), w2 ``[E, H, I]``, topk_weights
    ``[T, k]`` float32, topk_ids ``[T, k]`` int32/int64 -> ``[T, H]`` in hidden's dtype.

    An id outside ``[0, E)`` adds nothing (expert parallelism: another rank's expert). gpt-oss: ``w13_bias
    [E, 2I]``, ``w2_bias [E, H]`` (hidden's dtype) and the clamped SwiGLU ``swiglu``, as `reference.fused_moe`.
    ``activation="relu2"``: experts without a gate, w13 ``[E, I, H]`` (up rows only), ``relu(up) ** 2``;
    ``"gelu_tanh"``: ``gelu_tanh(gate) * up`` (Gemma 4's experts).
    ``fp8``: w13 and w2 in float8_e4m3fn with block scales (`reference.Fp8Experts`; ``bk`` 16, 32, 64 or 128, a
    multiple of 128, or at least H and I: one scale per row of K); or in int8 (W8A8 int8 experts) with a block
    covering all of K (at most `INT8_MAX_K` columns), each product's input quantized to int8 per token
    (`int8_quant.quantize_int8_per_token`).
    ``int_experts``: w13 ``[E, 2I, H / p]`` and w2 ``[E, H, I / p]`` packed int32 with their scales and zero points
    (`reference.IntExperts`: AWQ / GPTQ experts; act-order ones with each matrix's ``g_idx``), dequantized tile by
    tile.
    ``mxfp4``: w13 ``[E, 2I, H / 2]`` and w2 ``[E, H, I / 2]`` uint8, two e2m1 values a byte, with e8m0 scales per
    group of 32 inputs (`reference.Mxfp4Experts`: gpt-oss's checkpoints; H and I multiples of 32), dequantized tile
    by tile, exactly: the float path's result on the dequantized weights. One of ``fp8``, ``int_experts``, ``mxfp4``."""
    num_experts, inter = check_args(hidden, w13, w2, topk_weights, topk_ids, activation, fp8, int_experts, mxfp4)
    check_bias("w13_bias", w13_bias, hidden, (num_experts, w13.shape[1]))
    check_bias("w2_bias", w2_bias, hidden, (num_experts, hidden.shape[1]))
    (num_tokens, h), top_k = hidden.shape, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.zeros((num_tokens, top_k, h), dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0 or h == 0 or inter == 0:
        return out.sum(dim=1)
    act_order = int_experts is not None and (int_experts.w13_g_idx is not None or int_experts.w2_g_idx is not None)
    cfg = launch_config(num_pairs, num_experts, hidden.dtype, hidden.is_cuda, fp8.block[1] if fp8 else None,
                        int_experts is not None or mxfp4 is not None, act_order)
    aligned = align_tokens(topk_ids, num_experts, cfg.block_m)
    num_blocks = aligned.block_experts.shape[0]
    int8 = fp8 is not None and w13.dtype == torch.int8
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", FP8=fp8 is not None,
                  GROUP_N=fp8.block[0] if fp8 else 1, num_warps=cfg.num_warps, INT8=int8,
                  # fp8/int8 dots want K >= 32; the interpreter's fp8 dot is float16's, its int8 dot int32's (exact)
                  UPCAST=(fp8 is not None and cfg.block_k < 32) or (not hidden.is_cuda and not int8),
                  num_stages=cfg.num_stages)
    ints = int_experts
    consts.update(INT_BITS=ints.bits if ints else 0, MXFP4=mxfp4 is not None,
                  GROUP_K=ints.group if ints else fp8.block[1] if fp8 else MXFP4_GROUP if mxfp4 else 1)
    scaled = fp8 or ints or mxfp4  # NamedTuples: true when given
    a, a_s = _quantized(hidden, fp8, w13, 0)
    w_s, w_z = _weight_scales(0, hidden, fp8, ints, mxfp4)
    g_idx = _g_idx(0, hidden, ints)
    act = (torch.zeros if fp8 else torch.empty)((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        a, w13, act, aligned.sorted_pairs, aligned.block_experts, aligned.total_rows,
        hidden if w13_bias is None else w13_bias, a_s, w_s, w_z, g_idx,
        a.stride(0), w13.stride(0), w13.stride(1), act.stride(0), 0 if w13_bias is None else w13_bias.stride(0),
        a_s.stride(0), w_s.stride(0), w_s.stride(1) if scaled else 0, g_idx.stride(0),
        num_pairs, h, inter, swiglu.alpha if swiglu else 0.0, swiglu.limit if swiglu else 0.0,
        TOP_K=top_k, HAS_BIAS=w13_bias is not None, SWIGLU=swiglu is not None, GATED=activation != "relu2",
        GELU_TANH=activation == "gelu_tanh", G_IDX=g_idx is not hidden, **consts,
    )
    a, a_s = _quantized(act, fp8, w13, 1)
    w_s, w_z = _weight_scales(1, hidden, fp8, ints, mxfp4)
    g_idx = _g_idx(1, hidden, ints)
    out2 = out.view(num_pairs, h)
    _down_kernel[(num_blocks, triton.cdiv(h, cfg.block_n))](
        a, w2, out2, topk_weights.reshape(-1).contiguous(), aligned.sorted_pairs, aligned.block_experts,
        aligned.total_rows, hidden if w2_bias is None else w2_bias, a_s, w_s, w_z, g_idx,
        a.stride(0), w2.stride(0), w2.stride(1), out2.stride(0), 0 if w2_bias is None else w2_bias.stride(0),
        a_s.stride(0), w_s.stride(0), w_s.stride(1) if scaled else 0, g_idx.stride(0),
        num_pairs, h, inter, HAS_BIAS=w2_bias is not None, G_IDX=g_idx is not hidden, **consts,
    )
    return out.sum(dim=1)


def _quantized(x: torch.Tensor, fp8: Fp8Experts | None, w13: torch.Tensor,
               which: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of w13's (``which`` 0) or w2's (1) product as the kernels read it, (values, scales): fp8 per token
    group, or with the product's static input scale (every token's scale that one: `block_fp8.static_quant_fp8`,
    a Triton kernel), int8 per token for int8 experts (compressed-tensors' quantization, as the dense W8A8
    layers', in one Triton kernel), or the input itself (scales unread)."""
    if fp8 is None:
        return x, x
    if w13.dtype == torch.int8:
        return quantize_int8_per_token(x)
    input_scale = fp8.w13_input_scale if which == 0 else fp8.w2_input_scale
    if input_scale is not None:
        return static_quant_fp8(x, input_scale)
    return per_token_group_quant_fp8(x, fp8.block[1])


def _weight_scales(which: int, hidden: torch.Tensor, fp8: Fp8Experts | None, ints: IntExperts | None,
                   mxfp4: Mxfp4Experts | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zero points) of w13 (``which`` 0) or w2 (1) as the kernels take them; ``hidden`` where none (unread)."""
    if ints is not None:
        return (ints.w13_scales, ints.w13_zeros) if which == 0 else (ints.w2_scales, ints.w2_zeros)
    quant = fp8 if fp8 is not None else mxfp4
    return (hidden if quant is None else quant[which]), hidden


def _g_idx(which: int, hidden: torch.Tensor, ints: IntExperts | None) -> torch.Tensor:
    """The act-order groups ``[E, K]`` of w13 (``which`` 0) or w2 (1) as the kernels take them (``G_IDX``); ``hidden``
    where none (unread)."""
    g_idx = None if ints is None else ints.w13_g_idx if which == 0 else ints.w2_g_idx
    return hidden if g_idx is None else g_idx
