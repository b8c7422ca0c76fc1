"""Triton rotary embedding (GPT-NeoX layout) fused with the paged KV-cache write.

Two programs per token, grid ``(num_tokens, 2)``: program (t, 0) rotates all of
token t's query heads by its position (written to a new query tensor); program
(t, 1) rotates its key heads and stores them and the values into ``key_cache`` /
``value_cache`` at the token's slot (``block = slot // block_size``,
``offset = slot % block_size``); a negative slot is padding and is not stored.
Each loads the position and cos/sin itself, so the query and key/value chains of
dependent loads and stores run side by side (one program doing both took 3.85 us
per layer on an H200 at one decode token, 16 query heads, 8 KV heads, head dim
128). Dims past the rotary dim (``cos_sin_cache.shape[-1]``) pass through
unchanged.

With ``q_norm_weight`` / ``k_norm_weight`` (Qwen3's per-head q/k RMSNorm) each
query and key head is first RMS-normalised over its head dim, in the program
that rotates it: one launch instead of three, and q and k are read once. Values
are never normed; the stored key is the normed and rotated one.

Rounding follows `asyncllm.kernels.reference.norm_and_rotate` (HF's): the norm
takes its statistics in float32, rounds the normalised head to the activation
dtype and then the weight times it (as `reference.rms_norm`); the rotation
rounds cos and sin to the dtype, and each product and the sum, so
half-precision results match torch's bit for bit (and, with the norm, up to the
order of the float32 sum of squares). The kernel is compiled without floating-point
contraction (``enable_fp_fusion=False``): on an H200 (torch 2.11, Triton 3.6,
2026-11-29) Triton's default fused the products into multiply-adds and only 76-85%
of elements matched torch's bit for bit, in float32 and the half types alike; with
contraction off the real-shape and ULP tests passed.

An fp8 KV cache (``key_cache`` / ``value_cache`` of float8_e4m3fn or float8_e5m2,
kv_cache_dtype='fp8'): the key is computed and rounded in the activation dtype
exactly as above, then it and the value are stored as their nearest fp8 value,
saturated (`asyncllm.kernels._fp8.to_storage`), which is `reference.write_kv_cache`'s
cast bit for bit. The rotated query stays in the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import (
    check, check_float, check_kv_cache, check_last_dim_contiguous, check_same_device, check_token_vector,
)
from asyncllm.kernels._fp8 import to_storage
from asyncllm.kernels._kv_cache import copy_to_cache, slot_offset
from asyncllm.kernels._pdl import pdl_enter, pdl_launch

__all__ = ["rotary_embedding_with_kv_cache"]


@triton.jit
def _round(x, dtype):
    """x rounded to the activation dtype, kept in float32 for the next product."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_heads(x1, x2, rest, weight_ptr, eps, head_dim, half, dims, rest_dims, rest_mask, dtype):
    """RMSNorm of each head (a row) given as its two rotary halves and the pass-through rest
    (masked lanes are 0, so they add nothing to the sum of squares)."""
    sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(rest * rest, axis=1)
    rstd = tl.rsqrt(sum_sq / head_dim + eps)[:, None]
    w1 = tl.load(weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
    w_rest = tl.load(weight_ptr + rest_dims, mask=rest_mask, other=0.0).to(tl.float32)
    return (_round(w1 * _round(x1 * rstd, dtype), dtype), _round(w2 * _round(x2 * rstd, dtype), dtype),
            _round(w_rest * _round(rest * rstd, dtype), dtype))


@triton.jit
def _rotate_heads(
    src_ptr, src_token_stride, src_head_stride, dst_ptr, dst_token_stride, dst_head_stride,
    norm_weight_ptr, norm_eps,
    token, num_heads, head_dim, half, cos, sin, dtype,
    HEADS: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """(Norm and) rotate ``num_heads`` heads of one token from src into dst, rounding as torch does in the
    activation ``dtype``; stored in dst's element type (an fp8 KV cache: cast from the rounded result)."""
    store_dtype = dst_ptr.dtype.element_ty
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    rest_dims = tl.arange(0, HEAD_DIM)[None, :]
    rest_mask = (rest_dims >= 2 * half) & (rest_dims < head_dim)
    rest_heads_mask = (heads < num_heads) & rest_mask
    src = src_ptr + token * src_token_stride + heads * src_head_stride
    dst = dst_ptr + token * dst_token_stride + heads * dst_head_stride
    x1 = tl.load(src + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + dims, mask=mask, other=0.0).to(tl.float32)
    rest = tl.load(src + rest_dims, mask=rest_heads_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        x1, x2, rest = _rms_norm_heads(x1, x2, rest, norm_weight_ptr, norm_eps, head_dim, half, dims, rest_dims,
                                       rest_mask, src_ptr.dtype.element_ty)
    out1 = (_round(x1 * cos, dtype) + _round(-x2 * sin, dtype)).to(dtype)
    out2 = (_round(x2 * cos, dtype) + _round(x1 * sin, dtype)).to(dtype)
    tl.store(dst + dims, to_storage(out1, store_dtype), mask=mask)
    tl.store(dst + half + dims, to_storage(out2, store_dtype), mask=mask)
    tl.store(dst + rest_dims, to_storage(rest.to(dtype), store_dtype), mask=rest_heads_mask)


@triton.jit
def _cos_sin(cos_sin_ptr, position, cos_sin_stride, half, HALF: tl.constexpr, dtype):
    """The position's cos and sin rows ``[1, HALF]``, rounded to the activation dtype (as torch's)."""
    dims = tl.arange(0, HALF)[None, :]
    row = cos_sin_ptr + position * cos_sin_stride
    cos = _round(tl.load(row + dims, mask=dims < half, other=0.0), dtype)
    sin = _round(tl.load(row + half + dims, mask=dims < half, other=0.0), dtype)
    return cos, sin


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr,
    q_norm_ptr, k_norm_ptr,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride,
    q_out_token_stride, q_out_head_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride, cos_sin_stride,
    num_q_heads, num_kv_heads, head_dim, half, block_size, norm_eps,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid ``(num_tokens, 2)``: program (t, 0) rotates token t's query heads, program (t, 1) its key
    heads into the cache and copies its values there (nothing when its slot is negative)."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    if tl.program_id(1) == 0:
        position = tl.load(positions_ptr + token).to(tl.int64)
        cos, sin = _cos_sin(cos_sin_ptr, position, cos_sin_stride, half, HALF, dtype)
        _rotate_heads(q_ptr, q_token_stride, q_head_stride, q_out_ptr, q_out_token_stride, q_out_head_stride,
                      q_norm_ptr, norm_eps, token, num_q_heads, head_dim, half, cos, sin, dtype,
                      Q_HEADS, HALF, HEAD_DIM, HAS_NORM)
    else:
        position = tl.load(positions_ptr + token).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            cos, sin = _cos_sin(cos_sin_ptr, position, cos_sin_stride, half, HALF, dtype)
            cache_offset = slot_offset(slot, block_size, cache_block_stride, cache_slot_stride)
            _rotate_heads(k_ptr, k_token_stride, k_head_stride, k_cache_ptr + cache_offset, 0, cache_head_stride,
                          k_norm_ptr, norm_eps, token, num_kv_heads, head_dim, half, cos, sin, dtype,
                          KV_HEADS, HALF, HEAD_DIM, HAS_NORM)
            heads = tl.arange(0, KV_HEADS)[:, None]
            all_dims = tl.arange(0, HEAD_DIM)[None, :]
            mask = (heads < num_kv_heads) & (all_dims < head_dim)
            copy_to_cache(v_ptr + token * v_token_stride + heads * v_head_stride + all_dims,
                          v_cache_ptr + cache_offset + heads * cache_head_stride + all_dims, mask)


def _check_args(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_float(name, t, 3)
        check_last_dim_contiguous(name, t)
    num_tokens, _, head_dim = query.shape
    check(key.shape == value.shape and key.shape[0] == num_tokens and key.shape[2] == head_dim,
          f"key/value must be [T, Hkv, {head_dim}] with T={num_tokens}: {tuple(key.shape)}, {tuple(value.shape)}")
    check(key.dtype == query.dtype == value.dtype, "query, key and value must share a dtype")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_kv_cache(name, t, 4)
        check_last_dim_contiguous(name, t)
        check(tuple(t.shape[2:]) == (key.shape[1], head_dim), f"{name} must be [blocks, block_size, Hkv, D]")
    check(key_cache.stride() == value_cache.stride(), "key_cache and value_cache must share strides")
    check(key_cache.dtype == value_cache.dtype, "key_cache and value_cache must share a dtype")
    check(key_cache.dtype == query.dtype or key_cache.dtype.itemsize == 1,
          f"the KV cache must be of the query's dtype {query.dtype} or an fp8 type, got {key_cache.dtype}")
    check_token_vector("positions", positions, num_tokens)
    check_token_vector("slot_mapping", slot_mapping, num_tokens)
    check(cos_sin_cache.dim() == 2 and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(-1) == 1,
          "cos_sin_cache must be float32 [max_position, rotary_dim] contiguous in its last dim")
    rotary_dim = cos_sin_cache.shape[1]
    check(rotary_dim % 2 == 0 and rotary_dim <= head_dim, f"rotary dim {rotary_dim} must be even and <= {head_dim}")
    check_same_device(query=query, key=key, value=value, positions=positions, cos_sin_cache=cos_sin_cache,
                      key_cache=key_cache, slot_mapping=slot_mapping)


def _check_norm(query: torch.Tensor, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                norm_eps: float | None) -> None:
    check((q_norm_weight is None) == (k_norm_weight is None) == (norm_eps is None),
          "q_norm_weight, k_norm_weight and norm_eps go together: give all three or none")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None:
            check(weight.shape == (query.shape[2],) and weight.is_contiguous(),
                  f"{name} must be a contiguous [{query.shape[2]}]: {tuple(weight.shape)}")
            check(weight.dtype == query.dtype, f"{name} dtype {weight.dtype} must equal the query's {query.dtype}")
            check_same_device(query=query, **{name: weight})


def rotary_embedding_with_kv_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """Rotate query ``[T, Hq, D]`` and key ``[T, Hkv, D]``; store rotated keys and values at their slots.

    ``key_cache`` / ``value_cache`` are ``[num_blocks, block_size, Hkv, D]`` (e.g. ``kv_cache[0]``,
    ``kv_cache[1]``). With ``q_norm_weight`` / ``k_norm_weight`` (``[D]``) and ``norm_eps``, each
    query and key head is RMS-normalised before the rotation. Returns the rotated query (a new
    contiguous tensor).
    """
    _check_args(query, key, value, positions, cos_sin_cache, key_cache, value_cache, slot_mapping)
    _check_norm(query, q_norm_weight, k_norm_weight, norm_eps)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, half = key.shape[1], cos_sin_cache.shape[1] // 2
    query_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return query_out
    has_norm = q_norm_weight is not None
    _rotary_kv_kernel[(num_tokens, 2)](  # (t, 0): the query; (t, 1): the key and value
        query, key, value, query_out, key_cache, value_cache, positions, cos_sin_cache, slot_mapping,
        q_norm_weight if has_norm else query, k_norm_weight if has_norm else query,  # unread without the norm
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        query_out.stride(0), query_out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, head_dim, half, key_cache.shape[1], norm_eps if has_norm else 0.0,
        Q_HEADS=triton.next_power_of_2(num_q_heads), KV_HEADS=triton.next_power_of_2(num_kv_heads),
        HALF=triton.next_power_of_2(max(half, 1)), HEAD_DIM=triton.next_power_of_2(head_dim),
        HAS_NORM=has_norm, num_warps=4,
        enable_fp_fusion=False,  # torch rounds each product: a fused multiply-add would not (module doc)
        **pdl_launch(query.device),
    )
    return query_out
