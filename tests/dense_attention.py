"""Test helpers for the attention masks' rules: requests' keys and values written into a paged KV cache, and the
dense float64 attention the reference is checked against (tests/unit/test_attend_limit.py,
tests/unit/test_chunked_attention.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from model_utils import make_attn_metadata

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.kernels import reference

__all__ = ["dense_attention", "paged_contexts", "randn"]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def paged_contexts(step: list[tuple[int, int]], block_tables: list[list[int]], block_size: int, kv_heads: int,
                   head_dim: int) -> tuple[AttentionMetadata, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(causal metadata of a step of (cached, new) tokens per request, the paged kv_cache holding every request's
    random keys and values, each request's dense keys and values ``[n, Hkv, D]``)."""
    cached, scheduled = [c for c, _ in step], [n for _, n in step]
    metadata, _ = make_attn_metadata(cached, scheduled, block_tables, block_size)
    kv_cache = torch.zeros(2, 10, block_size, kv_heads, head_dim)
    contexts = []
    for i, table in enumerate(block_tables):
        n = cached[i] + scheduled[i]
        keys, values = randn(n, kv_heads, head_dim, seed=10 + i), randn(n, kv_heads, head_dim, seed=20 + i)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        reference.write_kv_cache(keys, values, kv_cache, slots)
        contexts.append((keys, values))
    return metadata, kv_cache, contexts


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    sees: Callable[[int, int, int], bool]) -> torch.Tensor:
    """float64 ``softmax(q @ k^T * scale, masked) @ v`` for one request's queries ``[q_len, Hq, D]`` (the last
    ``q_len`` of its ``n`` positions); ``sees(i, p, k)``: whether its i-th query, at position p, sees key k."""
    n, q_len = keys.shape[0], q.shape[0]
    mask = torch.tensor([[sees(i, p, k) for k in range(n)] for i, p in enumerate(range(n - q_len, n))])
    groups = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, 1).transpose(0, 1)  # [Hq, n, D]
    v = values.double().repeat_interleave(groups, 1).transpose(0, 1)
    scores = (q.double().transpose(0, 1) @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
