"""The unified Triton paged-attention kernel against `reference.paged_attention`
(itself checked against float64 loops in tests/unit/test_reference_ops.py)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.kernels import reference
from asyncllm.kernels.paged_attention import paged_attention
from kernel_testing import ATTENTION_TOL, DEVICE, DTYPES, assert_close, randn, requires_gpu

# (cached tokens, query tokens) per request: a decode, a chunk continuing a cached prefix,
# a fresh prefill, a decode at position 1, a request with no query this step, a long decode
MIXED_STEP = [(37, 1), (23, 7), (0, 19), (1, 1), (5, 0), (70, 1)]


def _metadata(requests: list[tuple[int, int]], block_size: int, seed: int) -> AttentionMetadata:
    """Each request's blocks drawn at random from the whole cache (block tables padded with 0)."""
    per_req = [-(-(cached + new) // block_size) for cached, new in requests]
    blocks = list(range(sum(per_req) + 2))
    random.Random(seed).shuffle(blocks)
    tables, start = [], 0
    for n in per_req:
        tables.append(blocks[start : start + n])
        start += n
    width = max(per_req)
    query_start_loc = [0]
    for _, new in requests:
        query_start_loc.append(query_start_loc[-1] + new)
    seq_lens = [cached + new for cached, new in requests]
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE),  # the step's K/V are already cached
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )


def _inputs(
    metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_cache, query): the whole cache is random, so a read of a wrong block or slot changes the output."""
    num_blocks = int(metadata.block_tables.max()) + 2
    kv_cache = randn(2, num_blocks, metadata.block_size, num_kv_heads, head_dim, dtype=dtype, seed=1)
    query = randn(metadata.query_start_loc_cpu[-1], num_heads, head_dim, dtype=dtype, seed=2)
    return kv_cache, query


def _check(
    requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, sliding_window: int | None = None, tile_n: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
) -> None:
    metadata = _metadata(requests, block_size, seed=num_heads * head_dim)
    kv_cache, query = _inputs(metadata, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = paged_attention(
        query, kv_cache[0], kv_cache[1], metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
        scale, sliding_window, tile_n=tile_n, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
    )
    expected = reference.paged_attention(query, kv_cache, metadata, scale, sliding_window, softcap, sinks,
                                         alibi_slopes=alibi_slopes)
    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out, expected, ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [
        (4, 4, 64, 16),  # multi-head attention
        (8, 2, 128, 4),  # GQA 4:1, head dim 128, small blocks
        (6, 2, 24, 8),  # 3 queries per KV head, head dim not a power of two
        (2, 1, 16, 1),  # block size 1
    ],
)
def test_mixed_prefill_and_decode(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    _check(MIXED_STEP, num_heads, num_kv_heads, head_dim, block_size, dtype, tile_n=16)


@pytest.mark.parametrize("sliding_window", [1, 5, 64])
def test_sliding_window(sliding_window: int) -> None:
    _check(MIXED_STEP, 4, 2, 32, 4, torch.float32, sliding_window=sliding_window, tile_n=16)


@pytest.mark.parametrize("softcap, sliding_window, dtype", [(2.0, None, torch.float16), (0.5, 5, torch.float32)])
def test_softcap(softcap: float, sliding_window: int | None, dtype: torch.dtype) -> None:
    """Gemma 2's score cap, alone and with a window; caps well under the scores' spread (a few units at
    this scale), so a kernel that skipped it would be far off."""
    _check(MIXED_STEP, 6, 2, 24, 4, dtype, sliding_window=sliding_window, tile_n=16, softcap=softcap)


def sink_logits(num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss's per-head sink logits, spread over the scores' range and beyond (a sink of 3 takes most of a
    row's probability mass, one of -3 little), so a kernel that dropped or doubled the sink would be far off."""
    return torch.linspace(-3.0, 3.0, num_heads, dtype=torch.float32).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_sinks(sliding_window: int | None, dtype: torch.dtype) -> None:
    """gpt-oss's attention sinks, alone and with a window (its sliding layers), at an odd head dim and 3:1 GQA:
    the attention tolerances of kernel_testing.py."""
    _check(MIXED_STEP, 6, 2, 24, 4, dtype, sliding_window=sliding_window, tile_n=16, sinks=sink_logits(6, dtype))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes from 0.5 down to 1/64 (BLOOM's and MPT's span): over MIXED_STEP's 70-token contexts the bias
    reaches tens, far beyond the scores' spread, so a kernel that dropped it, took the wrong head's or measured
    the distance from the wrong query position would be far off."""
    return torch.logspace(-1, -6, num_heads, base=2.0, dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, sliding_window",
                         [(6, 6, 24, None), (6, 2, 24, None), (8, 2, 64, 5)])
def test_alibi(num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None, dtype: torch.dtype) -> None:
    """ALiBi (BLOOM, MPT) over prefill chunks continuing cached prefixes, fresh prefills and decodes: multi-head
    as the models run it, then under GQA and a window (the kernel's rows map to heads either way)."""
    _check(MIXED_STEP, num_heads, num_kv_heads, head_dim, 4, dtype, sliding_window=sliding_window, tile_n=16,
           alibi_slopes=alibi_slopes(num_heads))


# (cached tokens, query tokens, image runs as [start, end) offsets into the chunk) per request: a run inside a
# chunk over a cached prefix, a fresh prefill that is all one image, a run reaching the chunk's end, two runs, a decode
IMAGE_STEP = [(5, 12, [(2, 9)]), (0, 10, [(0, 10)]), (9, 13, [(6, 13)]), (3, 11, [(0, 3), (5, 8)]), (20, 1, [])]


def image_limits(step: list[tuple[int, int, list[tuple[int, int]]]], dtype: torch.dtype) -> torch.Tensor:
    """`AttentionMetadata.attend_limit` of a step: each token's own position, the last of its run for an image's."""
    limits = []
    for cached, new, runs in step:
        chunk = list(range(cached, cached + new))
        for start, end in runs:
            chunk[start:end] = [cached + end - 1] * (end - start)
        limits += chunk
    return torch.tensor(limits, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("sliding_window", [None, 4])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, dtype, limit_dtype",
    [
        (8, 2, 64, 4, torch.float32, torch.int32),  # GQA 4:1: 4-token query blocks, so the runs cross blocks
        (6, 2, 24, 8, torch.float16, torch.int64),  # 3 queries per KV head, head dim not a power of two
    ],
)
def test_attend_limit(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, limit_dtype: torch.dtype,
    sliding_window: int | None,
) -> None:
    """Gemma 3's image tokens see their whole run (a window of 4, under the chunks' lengths, still cutting in):
    the kernel matches the reference; image rows differ from causal attention, the other rows do not."""
    metadata = _metadata([(cached, new) for cached, new, _ in IMAGE_STEP], block_size, seed=num_heads * head_dim)
    metadata.attend_limit = image_limits(IMAGE_STEP, limit_dtype)
    kv_cache, query = _inputs(metadata, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    args = (query, kv_cache[0], kv_cache[1], metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
            scale, sliding_window)
    out = paged_attention(*args, tile_n=16, attend_limit=metadata.attend_limit)
    expected = reference.paged_attention(query, kv_cache, metadata, scale, sliding_window)
    assert_close(out, expected, ATTENTION_TOL[dtype])
    causal = paged_attention(*args, tile_n=16)
    positions = image_limits([(cached, new, []) for cached, new, _ in IMAGE_STEP], limit_dtype)
    sees_ahead = metadata.attend_limit > positions
    assert_close(out[~sees_ahead], causal[~sees_ahead], ATTENTION_TOL[dtype])
    assert (out[sees_ahead] - causal[sees_ahead]).float().abs().amax(dim=(1, 2)).min() > 0.05


# (cached tokens, query tokens) per request for Llama 4's chunked local layers: prefill chunks over cached prefixes
# straddling chunk boundaries (positions 5..17, 30..35), a fresh prefill over several chunks, decodes at a chunk's
# first position (16) and within one (37), a request with no query this step
CHUNKED_STEP = [(5, 13), (0, 21), (16, 1), (37, 1), (30, 6), (3, 0)]


def step_positions(requests: list[tuple[int, int]]) -> torch.Tensor:
    """Each query token's position in its sequence, the step's tokens laid end to end."""
    return torch.tensor([p for cached, new in requests for p in range(cached, cached + new)], device=DEVICE)


@pytest.mark.parametrize("attention_chunk_size", [1, 5, 8, 16])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, dtype",
    [
        (8, 2, 32, 4, torch.float32),  # GQA 4:1: 4-token query blocks, rows of one program in two chunks
        (6, 2, 24, 8, torch.float16),  # 3 queries per KV head, head dim not a power of two
    ],
)
def test_chunked_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, attention_chunk_size: int
) -> None:
    """Llama 4's chunked local attention (a query at p sees keys ``(p // C) * C .. p``) matches the reference, with
    tiles of 16 keys that a chunk start cuts (C 5) or skips (the decode at 37 with C 8 starts at tile 32); the rows
    in their request's first chunk equal causal attention, the others do not."""
    metadata = _metadata(CHUNKED_STEP, block_size, seed=num_heads * head_dim)
    kv_cache, query = _inputs(metadata, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    args = (query, kv_cache[0], kv_cache[1], metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale)
    out = paged_attention(*args, tile_n=16, attention_chunk_size=attention_chunk_size)
    expected = reference.paged_attention(query, kv_cache, metadata, scale, attention_chunk_size=attention_chunk_size)
    assert_close(out, expected, ATTENTION_TOL[dtype])
    causal = _chunked_step_causal(num_heads, num_kv_heads, head_dim, block_size, dtype)
    first_chunk = step_positions(CHUNKED_STEP) < attention_chunk_size
    assert_close(out[first_chunk], causal[first_chunk], ATTENTION_TOL[dtype])
    assert (out[~first_chunk] - causal[~first_chunk]).float().abs().amax(dim=(1, 2)).min() > 0.01


@functools.lru_cache(maxsize=None)
def _chunked_step_causal(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    """`test_chunked_attention`'s step without a chunk: the same for every chunk size, so run once a shape."""
    metadata = _metadata(CHUNKED_STEP, block_size, seed=num_heads * head_dim)
    kv_cache, query = _inputs(metadata, num_heads, num_kv_heads, head_dim, dtype)
    return paged_attention(query, kv_cache[0], kv_cache[1], metadata.query_start_loc, metadata.seq_lens,
                           metadata.block_tables, head_dim**-0.5, tile_n=16)


@pytest.mark.parametrize("attention_chunk_size", [3, 8])
def test_chunked_attention_with_attend_limit(attention_chunk_size: int) -> None:
    """The chunk start still bounds the keys of image tokens, whose limits reach past their own positions."""
    metadata = _metadata([(cached, new) for cached, new, _ in IMAGE_STEP], 4, seed=5)
    metadata.attend_limit = image_limits(IMAGE_STEP, torch.int32)
    kv_cache, query = _inputs(metadata, 8, 2, 32, torch.float32)
    out = paged_attention(query, kv_cache[0], kv_cache[1], metadata.query_start_loc, metadata.seq_lens,
                          metadata.block_tables, 0.2, tile_n=16, attend_limit=metadata.attend_limit,
                          attention_chunk_size=attention_chunk_size)
    expected = reference.paged_attention(query, kv_cache, metadata, 0.2, attention_chunk_size=attention_chunk_size)
    assert_close(out, expected, ATTENTION_TOL[torch.float32])


def test_decode_batch_only() -> None:
    _check([(c, 1) for c in (0, 3, 16, 17, 40)], 4, 2, 64, 16, torch.float32)


def test_launcher_rejects_bad_arguments() -> None:
    md = _metadata([(3, 2)], 4, seed=0)
    cache = randn(2, 4, 4, 2, 16, dtype=torch.float32, seed=3)
    query = randn(2, 3, 16, dtype=torch.float32, seed=4)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(query, cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.25)
    with pytest.raises(ValueError, match="head dim"):
        paged_attention(query[..., :8], cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.25)
    with pytest.raises(ValueError, match="query_start_loc must be"):
        paged_attention(query[:, :2], cache[0], cache[1], md.seq_lens, md.seq_lens, md.block_tables, 0.25)
    with pytest.raises(ValueError, match="tile_n"):
        paged_attention(query[:, :2], cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.25,
                        tile_n=24)
    for bad_limit in (torch.tensor([3], device=DEVICE), torch.tensor([3.0, 4.0], device=DEVICE)):
        with pytest.raises(ValueError, match="attend_limit"):
            paged_attention(query[:, :2], cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.25,
                            attend_limit=bad_limit)
    for window, chunk, message in ((None, 0, "attention_chunk_size must be >= 1"), (4, 8, "not both")):
        with pytest.raises(ValueError, match=message):
            paged_attention(query[:, :2], cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.25,
                            window, attention_chunk_size=chunk)


def test_launchers_refuse_strided_or_2d_step_vectors() -> None:
    """The kernels read request i's ``seq_lens`` and ``query_start_loc`` at ``ptr + i``: a strided view (every other
    element of a wider buffer) read the wrong lengths and gave wrong outputs (max error 0.9, or 1e21 for the query
    starts) with no error; now a ValueError naming it, from the unified and the split-KV launchers alike."""
    from asyncllm.kernels.paged_decode import paged_decode

    md = _metadata([(5, 1), (9, 1), (20, 1)], 4, seed=0)
    cache, query = _inputs(md, 4, 2, 16, torch.float32)

    def every_other(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t, torch.zeros_like(t)], 1).reshape(-1)[::2]

    args = (md.query_start_loc, md.seq_lens, md.block_tables)
    for index, name in ((0, "query_start_loc"), (1, "seq_lens")):
        bad = list(args)
        bad[index] = every_other(args[index])
        assert torch.equal(bad[index], args[index]) and bad[index].stride() == (2,)
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            paged_attention(query, cache[0], cache[1], *bad, 0.25)
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            paged_decode(query, cache[0], cache[1], *bad, 0.25, 2)
    with pytest.raises(ValueError, match=r"seq_lens must be \[R\]"):
        paged_attention(query, cache[0], cache[1], md.query_start_loc, md.seq_lens[:, None], md.block_tables, 0.25)

@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(16, 8), (32, 8)])  # Qwen3-0.6B, Llama-3.1-8B
def test_real_shapes(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    rng = random.Random(0)
    requests = [(rng.randint(0, 2000), 1) for _ in range(48)]  # decodes
    requests += [(rng.randint(0, 1500), rng.randint(100, 600)) for _ in range(6)]  # chunks over cached prefixes
    requests += [(0, 1024), (0, 37)]  # fresh prefills
    _check(requests, num_heads, num_kv_heads, 128, 16, dtype)
