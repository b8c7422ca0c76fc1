"""Torch references of attention: rotary embeddings, the paged KV cache's writes and gathers, and paged
attention itself (masks, sliding windows, chunks, soft caps, sinks, ALiBi).

Re-exported by asyncllm.kernels.reference, whose docstring states the conventions (transformers' order of
operations, no policy); the models and backends call them as ``reference.paged_attention`` and so on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncllm.attention.metadata import AttentionMetadata


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (GPT-NeoX rotary layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def build_cos_sin_cache(inv_freq: torch.Tensor, attention_scaling: float, max_position: int) -> torch.Tensor:
    """``[max_position, rotary_dim]`` float32: cos for the first half, sin for the second.

    Computed like HF's rotary embedding (``position.float() * inv_freq`` then cos/sin
    times the scaling), so the values are bit-identical to transformers'.
    """
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.to(torch.float32)[None, :]
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by their token's position (NeoX style).

    The rotary dim is ``cos_sin_cache.shape[-1]``; dims past it pass through
    unchanged (partial rotary). cos/sin are cast to q's dtype before the products,
    as HF does. Returns new tensors.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if rotary_dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)

    return rotate(q), rotate(k)


def to_kv_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a KV cache of ``dtype`` stores it: an fp8 type (scale 1.0) rounds to the nearest value and
    saturates at the largest finite one (as vLLM's conversion and the Triton KV write do); others cast."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
                   ) -> None:
    """Store k, v ``[T, Hkv, D]`` into ``kv_cache [2, num_blocks, block_size, Hkv, D]`` at their slots,
    cast to the cache's dtype (`to_kv_cache_dtype`: an fp8 cache holds the nearest fp8 values). ``v`` None: a
    one-part cache ``[1, ...]`` whose keys are the values too (latent attention).

    A negative slot marks a padding token, which is not written.
    """
    assert (v is None) == (kv_cache.shape[0] == 1), "values go to a two-part cache, none to a one-part cache"
    parts = [k] if v is None else [k, v]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, parts = slots[valid], [x[valid] for x in parts]
    parts = [to_kv_cache_dtype(x, kv_cache.dtype) for x in parts]
    if kv_cache.dtype.itemsize == 1:  # torch's CPU index_copy_ has no float8 kernel: copy the bytes
        kv_cache, parts = kv_cache.view(torch.uint8), [x.view(torch.uint8) for x in parts]
    for cache, x in zip(kv_cache, parts):
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, x)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached K and V ``[seq_len, Hkv, D]`` of one request, in order (of a one-part cache: its
    keys twice)."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].to(torch.long)
    raw = kv_cache.view(torch.uint8) if kv_cache.dtype.itemsize == 1 else kv_cache  # fp8: gather the bytes
    key = raw[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].view(kv_cache.dtype)
    value = raw[-1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].view(kv_cache.dtype)
    return key, value


def _context_mask(
    q_len: int, seq_len: int, sliding_window: int | None, device: torch.device, limit: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor | None:
    """Boolean ``[q_len, seq_len]`` (True = attend), or None when every key is visible.

    Query j sits at position ``seq_len - q_len + j``; it sees keys at or before it (at or before
    ``limit[j]`` when a ``[q_len]`` limit is given: `AttentionMetadata.attend_limit`), and with a
    sliding window only those after its own position minus ``sliding_window`` (HF's rule). With
    ``chunk_size`` C (Llama 4's chunked local attention) only the keys of its own chunk of C positions
    too: those at or after ``(position // C) * C`` (transformers' ``create_chunked_causal_mask``).
    """
    window_covers_all = sliding_window is None or sliding_window >= seq_len
    chunk_covers_all = chunk_size is None or chunk_size >= seq_len  # every position is in chunk 0
    if q_len == 1 and window_covers_all and chunk_covers_all and limit is None:
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= (q_pos if limit is None else limit.to(device)[:, None])
    if not window_covers_all:
        mask &= k_pos > q_pos - sliding_window
    if not chunk_covers_all:
        mask &= k_pos >= q_pos // chunk_size * chunk_size
    return mask


def alibi_bias(alibi_slopes: torch.Tensor, q_len: int, seq_len: int) -> torch.Tensor:
    """ALiBi's float32 score bias ``[H, q_len, seq_len]``: ``slope_h * (key_pos - query_pos)``, query j at position
    ``seq_len - q_len + j``. Relative to the query, so it stays small near the diagonal at any length; softmax is
    blind to the per-row constant by which it differs from BLOOM's and MPT's ``slope_h * key_pos``."""
    device = alibi_slopes.device
    distance = (torch.arange(seq_len, device=device)[None, :]
                - torch.arange(seq_len - q_len, seq_len, device=device)[:, None])
    return alibi_slopes.float()[:, None, None] * distance.float()


def _eager_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None, sinks: torch.Tensor | None, alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with explicit scores, in transformers' eager order: capped to ``softcap * tanh(q.k * scale /
    softcap)`` when ``softcap`` (Gemma 2), ALiBi's bias added in float32 when ``alibi_slopes [H]`` (BLOOM, MPT:
    `alibi_bias`), masked, joined by each head's sink logit ``sinks [H]`` as one more
    column of the softmax (gpt-oss: it takes probability mass and adds no value), a float32 softmax rounded to
    the dtype, then ``P @ V``. ``[H, L, D]`` heads first."""
    groups = query.shape[0] // key.shape[0]
    key, value = key.repeat_interleave(groups, 0), value.repeat_interleave(groups, 0)
    scores = query @ key.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        scores = scores.float() + alibi_bias(alibi_slopes, scores.shape[1], scores.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ value
    sink_column = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1, dtype=torch.float32)
    return probs[..., :-1].to(query.dtype) @ value


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each request's queries over its whole cached context.

    ``query`` is ``[T, Hq, D]`` for the flattened step; the step's K/V must already be
    in ``kv_cache`` (of query's dtype, or fp8: the gathered K/V are cast to query's dtype).
    Returns ``[T, Hq, D]``; rows past ``query_start_loc[-1]`` (padding) are zero. One
    ``scaled_dot_product_attention`` call per request; with ``softcap`` (Gemma 2's
    attn_logit_softcapping; None or 0 is off) the scores are capped first, and with ``sinks`` (gpt-oss: a
    logit per query head, ``[Hq]``) each softmax's denominator takes ``exp(sink)`` too (`_eager_attention`).
    With ``metadata.attend_limit`` a query sees the keys up to its limit instead of its own position.
    With ``attention_chunk_size`` C (Llama 4's chunked local layers; None: off) a query at position p sees
    only the keys at or after ``(p // C) * C`` too (`_context_mask`); a layer has a window or a chunk size,
    never both (ValueError). With ``alibi_slopes`` (``[Hq]`` float32: BLOOM, MPT) each score gets
    ``slope_h * (key_pos - query_pos)`` added before the mask (`alibi_bias`).
    """
    if attention_chunk_size is not None:
        if sliding_window is not None:
            raise ValueError(f"a layer has sliding_window ({sliding_window}) or attention_chunk_size "
                             f"({attention_chunk_size}), not both")
        if attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1: {attention_chunk_size}")
    out = torch.zeros_like(query)
    qsl = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        key, value = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
        limit = None if metadata.attend_limit is None else metadata.attend_limit[start:end]
        mask = _context_mask(end - start, seq_len, sliding_window, query.device, limit, attention_chunk_size)
        q = query[start:end].transpose(0, 1)
        k, v = (t.transpose(0, 1).to(query.dtype) for t in (key, value))
        if softcap or sinks is not None or alibi_slopes is not None:
            attended = _eager_attention(q, k, v, mask, scale, softcap, sinks, alibi_slopes)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended.transpose(0, 1)
    return out
