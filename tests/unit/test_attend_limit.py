"""`AttentionMetadata.attend_limit` in `reference.paged_attention` against dense masked softmax attention.

The rule (Gemma 3's bidirectional image tokens): a query at position p with limit L sees key k iff
``k <= L`` and, with a sliding window W, ``k > p - W``. Ordinary tokens have L = p (causal); the
tokens of an image's run have L = the run's last position.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dense_attention import dense_attention, paged_contexts, randn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.kernels import reference, reference_attention

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 4, 2, 8
# (cached tokens, query tokens, image runs as [start, end) positions in the sequence) per request: a run inside a
# chunk over a cached prefix, a fresh prefill with a run reaching its end, a decode
STEP = [(4, 9, [(6, 11)]), (0, 7, [(1, 3), (4, 7)]), (6, 1, [])]
BLOCK_TABLES = [[5, 1, 7, 9], [2, 6], [3, 0]]


def _limits(step: list[tuple[int, int, list[tuple[int, int]]]]) -> list[list[int]]:
    """Each request's query limits: a token's own position, the last of its run for an image token."""
    limits = []
    for cached, new, runs in step:
        own = list(range(cached, cached + new))
        limits.append([next((end - 1 for start, end in runs if start <= p < end), p) for p in own])
    return limits


def _step() -> tuple[AttentionMetadata, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(causal metadata of `STEP`, the paged kv_cache, each request's dense keys and values ``[n, Hkv, D]``)."""
    return paged_contexts([(c, n) for c, n, _ in STEP], BLOCK_TABLES, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def _dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, limits: list[int],
                     window: int | None, scale: float) -> torch.Tensor:
    return dense_attention(q, keys, values, scale,
                           lambda i, p, k: k <= limits[i] and (window is None or k > p - window))


def _with_limits(metadata: AttentionMetadata, limits: list[list[int]] | None) -> AttentionMetadata:
    """A copy of ``metadata`` whose ``attend_limit`` is ``limits`` flattened (None: causal)."""
    flat = None if limits is None else torch.tensor([x for request in limits for x in request], dtype=torch.int32)
    return replace(metadata, attend_limit=flat)


@pytest.mark.parametrize("window", [None, 3, 100])  # none, one under the chunks' lengths, one covering everything
def test_reference_follows_the_attend_limit_rule(window: int | None) -> None:
    limits = _limits(STEP)
    causal_metadata, kv_cache, contexts = _step()
    metadata = _with_limits(causal_metadata, limits)
    query = randn(metadata.query_start_loc_cpu[-1], NUM_HEADS, HEAD_DIM, seed=3)
    scale = HEAD_DIM**-0.5
    out = reference.paged_attention(query, kv_cache, metadata, scale, sliding_window=window)
    qsl = metadata.query_start_loc_cpu
    for i, (keys, values) in enumerate(contexts):
        expected = _dense_attention(query[qsl[i] : qsl[i + 1]], keys, values, limits[i], window, scale)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), expected, atol=1e-5, rtol=0)
    causal = reference.paged_attention(query, kv_cache, causal_metadata, scale, sliding_window=window)
    assert not torch.allclose(out, causal, atol=1e-3)  # the image runs change the result


def test_own_position_limits_are_causal() -> None:
    """Limits equal to the tokens' own positions give plain causal attention."""
    metadata, kv_cache, _ = _step()
    own = [list(range(c, c + n)) for c, n, _ in STEP]
    query = randn(metadata.query_start_loc_cpu[-1], NUM_HEADS, HEAD_DIM, seed=4)
    for window in (None, 3):
        causal = reference.paged_attention(query, kv_cache, metadata, 0.3, sliding_window=window)
        limited = reference.paged_attention(query, kv_cache, _with_limits(metadata, own), 0.3, sliding_window=window)
        torch.testing.assert_close(limited, causal, atol=1e-6, rtol=0)


def test_context_mask_literal() -> None:
    """4 queries at positions 2..5 of 6 keys, the first two an image run ending at 3, a window of 2."""
    mask = reference_attention._context_mask(4, 6, 2, torch.device("cpu"), torch.tensor([3, 3, 4, 5]))
    assert mask.int().tolist() == [
        [0, 1, 1, 1, 0, 0],  # position 2: keys 1..3 (the window drops key 0, the run adds key 3)
        [0, 0, 1, 1, 0, 0],  # position 3: keys 2..3
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert reference_attention._context_mask(1, 6, None, torch.device("cpu")) is None  # a causal decode needs no mask

