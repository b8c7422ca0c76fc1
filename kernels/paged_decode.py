"""Triton split-KV (flash-decoding) paged attention for decode-only steps.

The unified kernel (`asyncllm.kernels.paged_attention`) runs one program per
(query block, KV head): a decode batch of one request with 8 KV heads is 8
programs, each walking the whole context, on a GPU with 132 SMs. Here each
request's context is cut into ``NUM_SEGMENTS`` segments that separate programs
read at once, in two launches:

1. `_decode_segment_kernel`, grid ``(num_reqs, Hkv, NUM_SEGMENTS)``: the
   ``Hq / Hkv`` query heads of one KV head (rows padded to >= 16 for
   ``tl.dot``, as in the unified kernel) over one segment, with an online
   softmax; it stores the segment's unnormalised partial (row max, sum of
   ``p = exp(score - max)``, ``acc = sum(p * v)``) in a float32 workspace.
2. `_decode_combine_kernel`, grid ``(num_reqs, Hq)``: rescales the partials
   to their common max and stores ``sum(acc) / sum(sum of p)`` in the query's dtype.

A segment's length is computed on the device from the request's own
``seq_len`` (``ceil(span / (NUM_SEGMENTS * TILE_N)) * TILE_N`` keys of the span
``[window or chunk start, seq_len)``), so how a request's context is cut depends only on
its length, never on the batch; segments past the span are empty: stage 1
returns at once and stage 2 masks them out by the same arithmetic. The grid
and ``NUM_SEGMENTS`` depend only on host-known shapes, so a launch is
CUDA-graph capturable.

With ``attention_chunk_size`` C (Llama 4's chunked local attention) the span starts at the query's chunk
start ``((seq_len - 1) // C) * C`` instead (``USE_CHUNK``; off, compiled without it).

Scores are capped (``softcap``) and biased by ALiBi (``alibi_slopes``: ``slope_h * (key_pos - (seq_len - 1))``,
``USE_ALIBI``) as in the unified kernel. Attention sinks (``sinks``, gpt-oss) join
in stage 2 only, once per head: the sink's logit is one more partial max with sum ``exp(0)`` and a
zero accumulator (``USE_SINKS``; off, compiled without it).
An fp8 cache is read as in the unified kernel: K and V tiles cast to the query's
dtype before their products.

Every request holds at most one query token: one (a decode) or none (a padding
row of a CUDA-graph batch, with ``seq_len`` 0), which reads and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check
from asyncllm.kernels._math import softcap as cap_scores
from asyncllm.kernels._pdl import pdl_enter, pdl_launch
from asyncllm.kernels.paged_attention import (  # the unified kernel's rules and rows
    _block_shape, _check_args, _tile_shape, check_alibi_slopes, check_chunk, check_sinks, check_window_and_softcap,
)

__all__ = ["paged_decode"]


@triton.jit
def _segment_bounds(seq_len, sliding_window, chunk_size, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr,
                    NUM_SEGMENTS: tl.constexpr, TILE_N: tl.constexpr):
    """(first visible key, keys per segment, segments holding keys) of a request with ``seq_len`` keys."""
    kv_start = seq_len * 0
    if USE_WINDOW:  # the query sits at seq_len - 1 and sees the last `sliding_window` keys
        kv_start = tl.maximum(seq_len - sliding_window, 0)
    if USE_CHUNK:  # ... or the keys of its chunk of `chunk_size` positions, up to itself
        kv_start = tl.maximum(seq_len - 1, 0) // chunk_size * chunk_size
    span = seq_len - kv_start
    segment_len = tl.cdiv(tl.maximum(span, 1), NUM_SEGMENTS * TILE_N) * TILE_N
    return kv_start, segment_len, tl.cdiv(span, segment_len)


@triton.jit
def _decode_segment_kernel(
    max_ptr, sum_ptr, acc_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    alibi_ptr, scale, num_q_heads, head_dim, block_size, sliding_window, softcap, chunk_size,
    q_token_stride, q_head_stride, cache_block_stride, cache_slot_stride, cache_head_stride, block_table_stride,
    QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr,
    USE_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_start:  # padding: no query
        return
    seq_len = tl.load(seq_lens_ptr + req)
    kv_start, segment_len, _ = _segment_bounds(seq_len, sliding_window, chunk_size, USE_WINDOW, USE_CHUNK,
                                               NUM_SEGMENTS, TILE_N)
    seg_start = kv_start + segment * segment_len
    if seg_start >= seq_len:  # empty segment: stage 2 skips it
        return
    seg_end = tl.minimum(seg_start + segment_len, seq_len)

    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM)
    dim_mask = dims < head_dim
    q_offsets = q_start.to(tl.int64) * q_token_stride + heads[:, None] * q_head_stride + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if USE_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_mask, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * block_table_stride
    for tile_start in range(seg_start, seg_end, TILE_N):
        kv_pos = tile_start + tl.arange(0, TILE_N)
        kv_mask = kv_pos < seg_end  # every key of the segment is visible to the request's one query
        block = tl.load(table + kv_pos // block_size, mask=kv_mask, other=0).to(tl.int64)
        kv_offsets = (block * cache_block_stride + (kv_pos % block_size) * cache_slot_stride
                      + kv_head * cache_head_stride)
        k = tl.load(k_cache_ptr + kv_offsets[None, :] + dims[:, None],
                    mask=kv_mask[None, :] & dim_mask[:, None], other=0.0)  # [D, N]
        scores = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:
            scores = cap_scores(scores, softcap)
        if USE_ALIBI:  # the query sits at seq_len - 1
            scores += slopes[:, None] * (kv_pos - (seq_len - 1)).to(tl.float32)[None, :]
        scores = tl.where(row_mask[:, None] & kv_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows never see a key
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :],
                    mask=kv_mask[:, None] & dim_mask[None, :], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    partial = (req.to(tl.int64) * num_q_heads + heads) * NUM_SEGMENTS + segment  # [R, Hq, NUM_SEGMENTS] index
    tl.store(max_ptr + partial, m_i, mask=row_mask)
    tl.store(sum_ptr + partial, l_i, mask=row_mask)
    tl.store(acc_ptr + partial[:, None] * head_dim + dims[None, :], acc, mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def _decode_combine_kernel(
    out_ptr, max_ptr, sum_ptr, acc_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    num_q_heads, head_dim, sliding_window, chunk_size, out_token_stride, out_head_stride,
    TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SEGMENTS: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_start:  # padding: no query
        return
    seq_len = tl.load(seq_lens_ptr + req)
    _, _, num_used = _segment_bounds(seq_len, sliding_window, chunk_size, USE_WINDOW, USE_CHUNK, NUM_SEGMENTS, TILE_N)
    segments = tl.arange(0, NUM_SEGMENTS)
    used = segments < num_used
    dims = tl.arange(0, HEAD_DIM)
    dim_mask = dims < head_dim
    partial = (req.to(tl.int64) * num_q_heads + head) * NUM_SEGMENTS + segments
    seg_max = tl.load(max_ptr + partial, mask=used, other=float("-inf"))
    seg_sum = tl.load(sum_ptr + partial, mask=used, other=0.0)
    acc = tl.load(acc_ptr + partial[:, None] * head_dim + dims[None, :], mask=used[:, None] & dim_mask[None, :],
                  other=0.0)
    m_max = tl.max(seg_max, axis=0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp(seg_max - m_safe)  # 0 for unused segments
    total = tl.sum(seg_sum * weight, axis=0)
    if USE_SINKS:
        total += tl.exp(sink - m_safe)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    out_offsets = q_start.to(tl.int64) * out_token_stride + head * out_head_stride + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_segments: int,
    sliding_window: int | None = None,
    tile_n: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` for a decode-only step, each request's context split into ``num_segments``.

    Same arguments and result as `asyncllm.kernels.paged_attention.paged_attention`, with
    ``query.shape[0] == num_reqs`` and at most one query token per request (requests with none
    are padding: read and written nothing). ``num_segments`` is a power of two (1 to 64).
    """
    _check_args(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables)
    num_reqs, num_q_heads, head_dim = query.shape
    check(seq_lens.shape[0] == num_reqs,
          f"a decode step has one query row per request: {num_reqs} rows, {seq_lens.shape[0]} requests")
    check(1 <= num_segments <= 64 and num_segments == triton.next_power_of_2(num_segments),
          f"num_segments must be a power of two from 1 to 64: {num_segments}")
    check_window_and_softcap(sliding_window, softcap)
    check_chunk(sliding_window, attention_chunk_size)
    sinks_arg = check_sinks(sinks, query)
    alibi_arg = check_alibi_slopes(alibi_slopes, query)
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    head_dim_padded, tile_n = _tile_shape(head_dim, tile_n)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_reqs == 0:
        return out
    # the segments' partials: row max, sum of exp(score - max), and the unnormalised output
    partial_max, partial_sum, partial_acc = (
        torch.empty(num_reqs, num_q_heads, num_segments, *dims, dtype=torch.float32, device=query.device)
        for dims in ((), (), (head_dim,))
    )
    shared = dict(USE_WINDOW=sliding_window is not None, USE_CHUNK=attention_chunk_size is not None,
                  NUM_SEGMENTS=num_segments, TILE_N=tile_n, HEAD_DIM=head_dim_padded)
    _, block_m = _block_shape(num_q_heads // num_kv_heads)
    _decode_segment_kernel[(num_reqs, num_kv_heads, num_segments)](
        partial_max, partial_sum, partial_acc, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        alibi_arg, scale, num_q_heads, head_dim, block_size, sliding_window or 0, softcap or 0.0, attention_chunk_size or 0,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_q_heads // num_kv_heads, BLOCK_M=block_m, USE_SOFTCAP=bool(softcap),
        USE_ALIBI=alibi_slopes is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # as the unified kernel
        num_warps=4, num_stages=2, **shared, **pdl_launch(query.device),
    )
    _decode_combine_kernel[(num_reqs, num_q_heads)](
        out, partial_max, partial_sum, partial_acc, seq_lens, query_start_loc, sinks_arg,
        num_q_heads, head_dim, sliding_window or 0, attention_chunk_size or 0, out.stride(0), out.stride(1),
        USE_SINKS=sinks is not None, num_warps=4 if head_dim_padded <= 128 else 8, **shared,
        **pdl_launch(query.device),
    )
    return out
