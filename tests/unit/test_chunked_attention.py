"""Llama 4's chunked local attention (``attention_chunk_size``) in `reference.paged_attention` against dense
masked softmax attention, and the `Attention` layer that carries it.

The rule (transformers' ``create_chunked_causal_mask``): a query at position p sees key k iff ``k <= p`` and
``k >= (p // C) * C``, the keys of its own chunk of C positions up to itself. With Gemma 3's ``attend_limit``
L the upper bound is ``k <= L`` instead, the chunk start still counted from p.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dense_attention import dense_attention, paged_contexts, randn
from model_utils import make_attn_metadata

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.torch_sdpa import TorchSDPABackend
from asyncllm.kernels import reference, reference_attention
from asyncllm.models.layers import Attention

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 6, 2, 8
# (cached tokens, query tokens) per request: a chunk over a cached prefix (positions 4..12), a fresh prefill,
# a decode, a request with no query this step
STEP = [(4, 9), (0, 7), (10, 1), (2, 0)]
BLOCK_TABLES = [[5, 1, 7, 9], [2, 6], [3, 0, 4], [8]]


def _step() -> tuple[AttentionMetadata, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(metadata of `STEP`, the paged kv_cache, each request's dense keys and values ``[n, Hkv, D]``)."""
    return paged_contexts(STEP, BLOCK_TABLES, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def _dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: int | None, scale: float,
                     limits: list[int] | None = None) -> torch.Tensor:
    return dense_attention(q, keys, values, scale, lambda i, p, k: k <= (p if limits is None else limits[i])
                           and (chunk is None or k >= p // chunk * chunk))


def _assert_follows_rule(out: torch.Tensor, query: torch.Tensor, metadata: AttentionMetadata,
                         contexts: list[tuple[torch.Tensor, torch.Tensor]], chunk: int | None, scale: float,
                         limits: list[list[int]] | None = None) -> None:
    qsl = metadata.query_start_loc_cpu
    for i, (keys, values) in enumerate(contexts):
        if qsl[i + 1] == qsl[i]:
            continue
        expected = _dense_attention(query[qsl[i] : qsl[i + 1]], keys, values, chunk, scale,
                                    None if limits is None else limits[i])
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), expected, atol=1e-5, rtol=0)


# 1: each query sees itself only; 3 and 4: chunks that the prefill chunks straddle; 11: only the last two queries
# over the cached prefix (positions 11, 12) reach past it; 100: longer than every sequence (plain causal attention)
@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 100])
def test_reference_follows_the_chunk_rule(chunk: int) -> None:
    metadata, kv_cache, contexts = _step()
    query = randn(metadata.query_start_loc_cpu[-1], NUM_HEADS, HEAD_DIM, seed=3)
    scale = HEAD_DIM**-0.5
    out = reference.paged_attention(query, kv_cache, metadata, scale, attention_chunk_size=chunk)
    _assert_follows_rule(out, query, metadata, contexts, chunk, scale)
    causal = reference.paged_attention(query, kv_cache, metadata, scale)
    if chunk == 100:
        torch.testing.assert_close(out, causal, atol=1e-6, rtol=0)
    else:
        assert not torch.allclose(out, causal, atol=1e-3)


@pytest.mark.parametrize("chunk", [3, 8])
def test_chunk_start_bounds_attend_limit(chunk: int) -> None:
    """Image runs (positions 6..10 and 1..2, 4..6) see up to their run's end, but not before their chunk."""
    metadata, kv_cache, contexts = _step()
    runs = [[(6, 11)], [(1, 3), (4, 7)], [], []]
    limits = [[next((end - 1 for start, end in r if start <= p < end), p) for p in range(c, c + n)]
              for (c, n), r in zip(STEP, runs)]
    metadata = replace(metadata, attend_limit=torch.tensor([x for request in limits for x in request]))
    query = randn(metadata.query_start_loc_cpu[-1], NUM_HEADS, HEAD_DIM, seed=4)
    out = reference.paged_attention(query, kv_cache, metadata, 0.3, attention_chunk_size=chunk)
    _assert_follows_rule(out, query, metadata, contexts, chunk, 0.3, limits)


def test_context_mask_literal() -> None:
    """4 queries at positions 3..6 of 7 keys, chunks of 3: keys 3..5 form one chunk, key 6 starts the next."""
    mask = reference_attention._context_mask(4, 7, None, torch.device("cpu"), chunk_size=3)
    assert mask.int().tolist() == [
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ]
    assert reference_attention._context_mask(1, 7, None, torch.device("cpu"), chunk_size=3).int().tolist() == [[0] * 6 + [1]]
    assert reference_attention._context_mask(1, 7, None, torch.device("cpu"), chunk_size=7) is None  # one chunk: causal


def test_window_and_chunk_size_are_refused_together() -> None:
    metadata, kv_cache, _ = _step()
    query = randn(metadata.query_start_loc_cpu[-1], NUM_HEADS, HEAD_DIM, seed=5)
    with pytest.raises(ValueError, match="not both"):
        reference.paged_attention(query, kv_cache, metadata, 0.3, sliding_window=4, attention_chunk_size=8)
    with pytest.raises(ValueError, match="attention_chunk_size must be >= 1"):
        reference.paged_attention(query, kv_cache, metadata, 0.3, attention_chunk_size=0)
    with pytest.raises(ValueError, match="not both"):
        Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TorchSDPABackend(), sliding_window=4, attention_chunk_size=8)


def test_attention_layer_passes_the_chunk_size() -> None:
    """`Attention` with ``attention_chunk_size`` writes the step's K/V and attends by the chunk rule."""
    cached, scheduled = [c for c, _ in STEP], [n for _, n in STEP]
    metadata, _ = make_attn_metadata(cached, scheduled, BLOCK_TABLES, BLOCK_SIZE)
    _, kv_cache, contexts = _step()
    qsl = metadata.query_start_loc_cpu
    key = torch.cat([keys[c:] for (keys, _), c in zip(contexts, cached)])
    value = torch.cat([values[c:] for (_, values), c in zip(contexts, cached)])
    kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)[:, metadata.slot_mapping] = 0  # the layer writes the step's K/V
    query = randn(qsl[-1], NUM_HEADS, HEAD_DIM, seed=6)
    layer = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TorchSDPABackend(), attention_chunk_size=3)
    assert "attention_chunk_size=3" in repr(layer)
    assert "attention_chunk_size" not in repr(Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, TorchSDPABackend()))
    out = layer(query, key, value, kv_cache, metadata)
    assert out.shape == (qsl[-1], NUM_HEADS * HEAD_DIM)
    _assert_follows_rule(out.view(-1, NUM_HEADS, HEAD_DIM), query, metadata, contexts, 3, HEAD_DIM**-0.5)
