"""A synthetic attention step at real shapes for the kernel micro-benchmark (random cache, shuffled blocks)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.attention.metadata import AttentionMetadata

__all__ = ["AttentionStep", "attention_step"]

_BLOCK_SIZE = 16


@dataclass
class AttentionStep:
    metadata: AttentionMetadata
    query: torch.Tensor
    kv_cache: torch.Tensor
    head_dim: int
    bytes_read: int
    """Bytes the kernel must move: queries and outputs, plus each request's cached K and V."""


def attention_step(
    cfg: dict[str, Any], requests: list[tuple[int, int]], dtype: torch.dtype, rng: random.Random,
    device: str | torch.device = "cuda",
) -> AttentionStep:
    """``requests`` are (cached tokens, query tokens); blocks are handed out shuffled."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_req = [-(-(cached + new) // _BLOCK_SIZE) for cached, new in requests]
    blocks = list(range(sum(per_req)))
    rng.shuffle(blocks)
    tables, start = [], 0
    for n in per_req:
        tables.append(blocks[start : start + n] + [0] * (max(per_req) - n))
        start += n
    qsl = [0]
    for _, new in requests:
        qsl.append(qsl[-1] + new)
    seq_lens = [cached + new for cached, new in requests]
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=_BLOCK_SIZE,
    )
    query = torch.randn(qsl[-1], heads, head_dim, dtype=dtype, device=device)
    kv_cache = torch.randn(2, len(blocks), _BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = (2 * query.numel() + 2 * sum(seq_lens) * kv_heads * head_dim) * size
    return AttentionStep(metadata, query, kv_cache, head_dim, nbytes)
