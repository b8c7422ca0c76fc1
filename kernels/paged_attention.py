"""Triton paged attention: one varlen kernel for prefill chunks (with cached context) and decodes.

The step's queries are laid end to end (``query_start_loc``); request i has
``seq_lens[i]`` tokens of context in the KV cache, the last ``q_len_i`` of them
being its queries (already written, e.g. by `rotary_embedding_with_kv_cache`).
Query j of request i sits at position ``seq_lens[i] - q_len_i + j`` and attends
causally to the keys at or before it (and, with a sliding window, only the
last ``sliding_window`` of them), as `asyncllm.kernels.reference.paged_attention`.
With ``softcap`` (Gemma 2) each score is capped to ``softcap * tanh(score / softcap)``
before the mask and the softmax; off, the kernel is compiled without it. With ``sinks``
(gpt-oss: one logit per query head) each row's softmax starts from its head's sink, as if one
more key scored ``sink`` and had a zero value: the running max starts at the sink and the running
sum at 1 (``USE_SINKS``; off, compiled without it). With ``attend_limit`` (Gemma 3's bidirectional
image tokens: one last visible key position per query token) a query sees the keys up to its limit
instead of its own position, the window still counting back from its position, and a program's key range
reaches its rows' largest limit (``USE_LIMIT``; off, compiled without it). With ``attention_chunk_size``
C (Llama 4's chunked local attention) a query at position p sees only the keys at or after ``(p // C) * C``
(the start of its chunk of C positions) too, on top of the causal rule or its limit; the key loop of a
program starts at its first row's chunk start (``USE_CHUNK``; off, compiled without it). A layer has a
sliding window or a chunk size, never both. With ``alibi_slopes`` (BLOOM's and MPT's ALiBi: one float32 slope per
query head) each score gets ``slope_h * (key_pos - query_pos)`` added after the cap and before the mask: relative to
the query, so the bias of the keys that matter stays small at any position (``USE_ALIBI``; off, compiled without it).

Grid: (query blocks, KV heads). A program takes ``BLOCK_Q`` consecutive query
tokens of one request times the ``Hq / Hkv`` query heads sharing one KV head
(GQA): ``BLOCK_M = BLOCK_Q * queries_per_kv`` rows, so a decode batch still
fills a matrix tile. It finds its request by binary search over
``query_start_loc`` (no host-side index, so the launch is graph-capturable),
then streams the context in tiles of ``TILE_N`` keys gathered through the block
table with an online softmax. Head dims that are not a power of two are padded
and masked. Offsets into the cache are int64 (blocks * block_size * heads *
head_dim overflows int32 on large caches).

The cache may hold fp8 (float8_e4m3fn or float8_e5m2, kv_cache_dtype='fp8'): each
loaded K and V tile is cast to the query's dtype before its product (exact: every
fp8 value is a float16, bfloat16 and float32 value), a no-op for a cache of the
query's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check, check_float, check_kv_cache, check_last_dim_contiguous, check_same_device
from asyncllm.kernels._math import softcap as cap_scores
from asyncllm.kernels._pdl import pdl_enter, pdl_launch

__all__ = ["paged_attention"]

_MIN_BLOCK_M = 16  # tl.dot needs M >= 16 on the GPU


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks contain ``q_block`` (request i starts at block qsl[i] // BLOCK_Q + i)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs"])  # per step: one compile serves every batch (docs/kernels.md)
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    attend_limit_ptr, alibi_ptr,
    scale, num_reqs, head_dim, block_size, sliding_window, softcap, chunk_size,
    q_token_stride, q_head_stride, out_token_stride, out_head_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride, block_table_stride,
    QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_LIMIT: tl.constexpr, USE_CHUNK: tl.constexpr, USE_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_pos = local_block * BLOCK_Q + rows // QUERIES_PER_KV  # index of the query within the request
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_mask = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_pos < q_len)
    dims = tl.arange(0, HEAD_DIM)
    dim_mask = dims < head_dim
    tokens = (q_start + q_pos).to(tl.int64)
    q_offsets = tokens[:, None] * q_token_stride + heads[:, None] * q_head_stride + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        m_i, l_i = _sink_start(sinks_ptr, heads, row_mask)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    abs_pos = context_len + q_pos  # the query's position in its sequence
    if USE_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_mask, other=0.0).to(tl.float32)
    # keys this block can see: up to its last query's position (and within the window or chunk of its first)
    kv_end = tl.minimum(context_len + (local_block + 1) * BLOCK_Q, seq_len)
    last_pos = abs_pos  # the last key each row sees
    if USE_LIMIT:
        last_pos, kv_end = _limit_range(attend_limit_ptr, tokens, row_mask, kv_end, seq_len)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + local_block * BLOCK_Q - sliding_window + 1, 0)
    if USE_CHUNK:  # rows come in position order: the first one's chunk starts first
        kv_start = (context_len + local_block * BLOCK_Q) // chunk_size * chunk_size
    table = block_tables_ptr + req.to(tl.int64) * block_table_stride
    for tile_start in range((kv_start // TILE_N) * TILE_N, kv_end, TILE_N):
        kv_pos = tile_start + tl.arange(0, TILE_N)
        kv_mask = kv_pos < kv_end
        block = tl.load(table + kv_pos // block_size, mask=kv_mask, other=0).to(tl.int64)
        kv_offsets = (block * cache_block_stride + (kv_pos % block_size) * cache_slot_stride
                      + kv_head * cache_head_stride)
        k_mask = kv_mask[None, :] & dim_mask[:, None]
        k = tl.load(k_cache_ptr + kv_offsets[None, :] + dims[:, None], mask=k_mask, other=0.0)  # [D, N]
        scores = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:
            scores = cap_scores(scores, softcap)
        if USE_ALIBI:
            scores += slopes[:, None] * (kv_pos[None, :] - abs_pos[:, None]).to(tl.float32)
        visible = row_mask[:, None] & kv_mask[None, :] & (kv_pos[None, :] <= last_pos[:, None])
        if USE_WINDOW:
            visible = visible & (kv_pos[None, :] > abs_pos[:, None] - sliding_window)
        if USE_CHUNK:
            visible = visible & (kv_pos[None, :] >= (abs_pos // chunk_size * chunk_size)[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_mask = kv_mask[:, None] & dim_mask[None, :]
        v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=v_mask, other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offsets = tokens[:, None] * out_token_stride + heads[:, None] * out_head_stride + dims[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def _limit_range(attend_limit_ptr, tokens, row_mask, kv_end, seq_len):
    """(each row's last visible key, the program's key range end widened to its rows' largest limit)."""
    limit = tl.load(attend_limit_ptr + tokens, mask=row_mask, other=0).to(tl.int32)  # masked rows: 0
    return limit, tl.minimum(tl.maximum(kv_end, tl.max(limit, axis=0) + 1), seq_len)


@triton.jit
def _sink_start(sinks_ptr, heads, row_mask):
    """The online softmax's (running max, running sum) before any key: the sink's logit, ``exp(0)``."""
    sink = tl.load(sinks_ptr + heads, mask=row_mask, other=float("-inf")).to(tl.float32)
    return sink, tl.where(row_mask, 1.0, 0.0)


def _check_args(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
) -> None:
    check_float("query", query, 3)
    check_last_dim_contiguous("query", query)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_kv_cache(name, t, 4)
        check_last_dim_contiguous(name, t)
        check(t.shape[3] == query.shape[2], f"{name} head dim {t.shape[3]} != query head dim {query.shape[2]}")
    check(key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride(),
          "key_cache and value_cache must share shape and strides")
    check(key_cache.dtype == value_cache.dtype, "key_cache and value_cache must share a dtype")
    check(key_cache.dtype == query.dtype or key_cache.dtype.itemsize == 1,
          f"the KV cache must be of the query's dtype {query.dtype} or an fp8 type, got {key_cache.dtype}")
    check(query.shape[1] % key_cache.shape[2] == 0,
          f"query heads {query.shape[1]} must be a multiple of KV heads {key_cache.shape[2]}")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [R], got shape {tuple(seq_lens.shape)}")
    num_reqs = seq_lens.shape[0]
    check(query_start_loc.dim() == 1 and query_start_loc.shape[0] == num_reqs + 1, "query_start_loc must be [R + 1]")
    check(block_tables.dim() == 2 and block_tables.shape[0] >= num_reqs and block_tables.stride(1) == 1,
          "block_tables must be [>= R, max_blocks] with unit stride in its last dim")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        check(t.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):  # read at ptr + i
        if t.stride(0) != 1 and t.shape[0] > 1:  # the message built only on failure (every layer)
            raise ValueError(f"{name} must be contiguous (stride 1): {t.stride()}")
    check_same_device(query=query, key_cache=key_cache, query_start_loc=query_start_loc, seq_lens=seq_lens,
                      block_tables=block_tables)


def check_window_and_softcap(sliding_window: int | None, softcap: float | None) -> None:
    check(sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1: {sliding_window}")
    check(softcap is None or softcap >= 0, f"softcap must be >= 0 (0: off): {softcap}")


def check_chunk(sliding_window: int | None, attention_chunk_size: int | None) -> None:
    """A chunk size (Llama 4's chunked local attention) is >= 1, and never comes with a sliding window."""
    check(attention_chunk_size is None or attention_chunk_size >= 1,
          f"attention_chunk_size must be >= 1: {attention_chunk_size}")
    check(attention_chunk_size is None or sliding_window is None,
          f"a layer has sliding_window ({sliding_window}) or attention_chunk_size ({attention_chunk_size}), not both")


def check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """``sinks`` checked to be one contiguous logit per query head; the query itself (never read) when None."""
    if sinks is None:
        return query
    check(sinks.dim() == 1 and sinks.shape[0] == query.shape[1] and sinks.is_floating_point()
          and sinks.stride(0) == 1, f"sinks must be a contiguous float [{query.shape[1]}], got {tuple(sinks.shape)}")
    check_same_device(query=query, sinks=sinks)
    return sinks


def check_alibi_slopes(alibi_slopes: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """``alibi_slopes`` checked to be one contiguous float32 slope per query head; the query (never read) when None."""
    if alibi_slopes is None:
        return query
    check(alibi_slopes.dim() == 1 and alibi_slopes.shape[0] == query.shape[1] and alibi_slopes.dtype == torch.float32
          and alibi_slopes.stride(0) == 1,
          f"alibi_slopes must be a contiguous float32 [{query.shape[1]}], got {tuple(alibi_slopes.shape)} "
          f"{alibi_slopes.dtype}")
    check_same_device(query=query, alibi_slopes=alibi_slopes)
    return alibi_slopes


def check_attend_limit(attend_limit: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """``attend_limit`` checked to be a contiguous integer vector over the query's tokens; the query (never read)
    when None."""
    if attend_limit is None:
        return query
    check(attend_limit.dim() == 1 and attend_limit.shape[0] >= query.shape[0] and attend_limit.stride(0) == 1,
          f"attend_limit must be a contiguous [>= {query.shape[0]}], got {tuple(attend_limit.shape)}")
    check(attend_limit.dtype in (torch.int32, torch.int64),
          f"attend_limit must be int32 or int64, got {attend_limit.dtype}")
    check_same_device(query=query, attend_limit=attend_limit)
    return attend_limit


def _block_shape(queries_per_kv: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): enough query tokens that BLOCK_Q * queries_per_kv rows fill a tile."""
    block_m = max(_MIN_BLOCK_M, triton.next_power_of_2(queries_per_kv))
    return block_m // queries_per_kv, block_m


def _tile_shape(head_dim: int, tile_n: int | None) -> tuple[int, int]:
    """(HEAD_DIM: the head dim padded to a power of two >= 16, TILE_N: keys per inner step, checked)."""
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    tile_n = tile_n or (64 if head_dim_padded <= 128 else 32)
    check(tile_n >= 16 and tile_n == triton.next_power_of_2(tile_n), f"tile_n must be a power of two >= 16: {tile_n}")
    return head_dim_padded, tile_n


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    tile_n: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attend_limit: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of query ``[T, Hq, D]`` over each request's cached context.

    ``key_cache`` / ``value_cache`` are ``[num_blocks, block_size, Hkv, D]``. Returns ``[T, Hq, D]``
    in query's dtype; rows past ``query_start_loc[-1]`` (padding) are left unwritten. ``tile_n``
    (keys per inner step, a power of two >= 16) defaults to 64 for head dims up to 128, else 32.
    ``softcap`` > 0 caps the scores (None or 0: off); ``sinks`` ``[Hq]`` joins each head's softmax (None: off).
    ``attend_limit`` ``[>= T]`` int32/int64: the last key position each query token sees (None: its own, causal).
    ``attention_chunk_size`` C: a query at position p sees no key before ``(p // C) * C`` (None: off; not
    with ``sliding_window``). ``alibi_slopes`` ``[Hq]`` float32: ALiBi's ``slope_h * (key_pos - query_pos)`` added to
    each score (None: off). ``num_warps`` / ``num_stages``: the launch's (None: the rule below; `bench
    attention-sweep` times others).
    """
    _check_args(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables)
    check(num_warps in (None, 1, 2, 4, 8, 16), f"num_warps must be a power of two from 1 to 16: {num_warps}")
    check(num_stages is None or (isinstance(num_stages, int) and 1 <= num_stages <= 8),
          f"num_stages must be from 1 to 8: {num_stages}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    queries_per_kv = num_q_heads // num_kv_heads
    head_dim_padded, tile_n = _tile_shape(head_dim, tile_n)
    check_window_and_softcap(sliding_window, softcap)
    check_chunk(sliding_window, attention_chunk_size)
    sinks_arg = check_sinks(sinks, query)
    limit_arg = check_attend_limit(attend_limit, query)
    alibi_arg = check_alibi_slopes(alibi_slopes, query)
    block_q, block_m = _block_shape(queries_per_kv)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, sinks_arg, limit_arg, alibi_arg,
        scale, num_reqs, head_dim, block_size, sliding_window or 0, softcap or 0.0, attention_chunk_size or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        HEAD_DIM=head_dim_padded, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=bool(softcap),
        USE_SINKS=sinks is not None, USE_LIMIT=attend_limit is not None, USE_CHUNK=attention_chunk_size is not None,
        USE_ALIBI=alibi_slopes is not None,
        # exact fp32 products; "tf32" is Triton's default, which half-precision inputs ignore
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps or (4 if head_dim_padded <= 64 else 8), num_stages=num_stages or 2,
        **pdl_launch(query.device),
    )
    return out
