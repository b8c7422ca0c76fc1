"""The split-KV decode kernels against `reference.paged_attention` and the unified kernel, and the
triton backend's choice between them.

Tolerances are the attention ones of kernel_testing.py (float32 2e-5, float16 4e-3, bfloat16 2.5e-2):
the split path rounds the probabilities to the query dtype per segment, so half types may differ
from the reference and from the unified kernel by a few units in the last place.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch
from test_paged_attention_kernel import _metadata, alibi_slopes, sink_logits

from asyncllm.attention import triton as triton_backend
from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.triton import TritonBackend, split_kv_segments
from asyncllm.kernels import reference
from asyncllm.kernels.paged_attention import paged_attention
from asyncllm.kernels.paged_decode import paged_decode
from kernel_testing import ATTENTION_TOL, DEVICE, DTYPES, assert_close, randn, requires_gpu

LENGTHS = [1, 15, 16, 17, 200]  # context lengths, each request's query included
SENTINEL = 1234.5  # what the launcher's output holds before the kernels run, in the padding tests


def _decode_step(
    lengths: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    padding: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A decode of each length, then ``padding`` rows as a CUDA-graph batch pads (empty query, seq_len 0)."""
    metadata = _metadata([(n - 1, 1) for n in lengths] + [(0, 0)] * padding, block_size, seed=num_heads + head_dim)
    num_blocks = int(metadata.block_tables.max()) + 2
    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=1)
    query = randn(len(lengths) + padding, num_heads, head_dim, dtype=dtype, seed=2)
    return metadata, query, kv_cache


def _decode(query, kv_cache, md: AttentionMetadata, num_segments: int, window: int | None = None, tile_n=16,
            softcap=None, sinks=None, chunk=None, alibi=None):
    return paged_decode(query, kv_cache[0], kv_cache[1], md.query_start_loc, md.seq_lens, md.block_tables,
                        query.shape[-1] ** -0.5, num_segments, window, tile_n=tile_n, softcap=softcap, sinks=sinks,
                        attention_chunk_size=chunk, alibi_slopes=alibi)


def _check(lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, num_segments=4, window=None, tile_n=16,
           softcap=None, sinks=None, alibi=None):
    md, query, kv_cache = _decode_step(lengths, num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = _decode(query, kv_cache, md, num_segments, window, tile_n, softcap, sinks, alibi=alibi)
    expected = reference.paged_attention(query, kv_cache, md, head_dim**-0.5, window, softcap, sinks,
                                         alibi_slopes=alibi)
    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out, expected, ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [
        (2, 2, 64, 16),  # multi-head attention
        (4, 2, 80, 5),  # GQA 2:1, head dim not a power of two, odd block size
        (4, 1, 64, 16),  # GQA 4:1
    ],
)
def test_decode_lengths(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Very different lengths in one batch: 200 keys fill 4 segments of 64, 15 to 17 keys use one or two."""
    _check(LENGTHS, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize("num_segments", [1, 2, 8])
def test_one_request_any_segment_count(num_segments: int) -> None:
    """A single request; with 8 segments of at least 16 keys, 40 keys leave 5 segments empty."""
    _check([40], 4, 2, 32, 4, torch.float32, num_segments=num_segments)


@pytest.mark.parametrize("window", [1, 5, 64])
def test_sliding_window(window: int) -> None:
    """The window's span is what is split: a window of 5 over 200 keys is one segment of one tile."""
    _check(LENGTHS, 4, 2, 32, 4, torch.float32, window=window)


@pytest.mark.parametrize("softcap, window, dtype", [(2.0, None, torch.float16), (0.5, 5, torch.float32)])
def test_softcap(softcap: float, window: int | None, dtype: torch.dtype) -> None:
    """Gemma 2's score cap in every segment (40 keys: 3 of 4 segments used), alone and with a window."""
    _check([1, 17, 40], 4, 2, 32, 4, dtype, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
def test_sinks(window: int | None, dtype: torch.dtype) -> None:
    """gpt-oss's attention sinks, counted once per head across the segments (40 keys: 3 of 4 segments used;
    a request of 1 key: one), alone and with a window; 6 query heads on 2 KV heads, head dim 24."""
    _check([1, 17, 40], 6, 2, 24, 4, dtype, window=window, sinks=sink_logits(6, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, window", [(4, 4, None), (6, 2, None), (4, 2, 5)])
def test_alibi(num_heads: int, num_kv_heads: int, window: int | None, dtype: torch.dtype) -> None:
    """ALiBi (BLOOM, MPT) in every segment, measured from each request's own last position (200 keys: 4 segments;
    1 key: one), multi-head as the models run it, under GQA and with a window."""
    _check(LENGTHS, num_heads, num_kv_heads, 32, 4, dtype, window=window, alibi=alibi_slopes(num_heads))


@pytest.mark.parametrize("chunk", [1, 8, 17, 64])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, dtype",
    [
        (4, 1, 32, 4, torch.float32),  # GQA 4:1
        (6, 2, 24, 5, torch.float16),  # 3 queries per KV head, head dim not a power of two, odd block size
    ],
)
def test_chunked_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, chunk: int
) -> None:
    """Llama 4's chunked local attention: the decode at position n - 1 sees keys ``((n - 1) // C) * C .. n - 1``,
    the span the segments split (200 keys with C 64: the 8 keys from 192, one segment; with C 17: 13 keys from
    187). The result matches the reference and the unified kernel; requests whose query is in its first chunk
    equal causal attention, the others do not."""
    md, query, kv_cache = _decode_step(LENGTHS, num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = _decode(query, kv_cache, md, 4, chunk=chunk)
    expected = reference.paged_attention(query, kv_cache, md, head_dim**-0.5, attention_chunk_size=chunk)
    assert_close(out, expected, ATTENTION_TOL[dtype])
    unified = paged_attention(query, kv_cache[0], kv_cache[1], md.query_start_loc, md.seq_lens, md.block_tables,
                              head_dim**-0.5, tile_n=16, attention_chunk_size=chunk)
    assert_close(out, unified, ATTENTION_TOL[dtype])
    causal = _causal_decode(num_heads, num_kv_heads, head_dim, block_size, dtype)
    first_chunk = torch.tensor(LENGTHS, device=DEVICE) - 1 < chunk
    assert_close(out[first_chunk], causal[first_chunk], ATTENTION_TOL[dtype])
    assert (out[~first_chunk] - causal[~first_chunk]).float().abs().amax(dim=(1, 2)).min() > 0.01


@functools.lru_cache(maxsize=None)
def _causal_decode(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    """`test_chunked_attention`'s decode step without a chunk: the same for every chunk size, so run once a shape."""
    md, query, kv_cache = _decode_step(LENGTHS, num_heads, num_kv_heads, head_dim, block_size, dtype)
    return _decode(query, kv_cache, md, 4)


def test_backend_passes_the_chunk_size() -> None:
    """The triton backend keeps a layer's chunk size in both kernels: a decode batch and a step with a prefill."""
    backend = TritonBackend()
    for requests in ([(20, 1), (9, 1)], [(20, 1), (5, 7)]):
        md = _metadata(requests, 4, seed=0)
        kv_cache = randn(2, int(md.block_tables.max()) + 2, 4, 2, 16, dtype=torch.float32, seed=1)
        md.slot_mapping = torch.full((md.query_start_loc_cpu[-1],), -1, dtype=torch.int64, device=DEVICE)
        query = randn(md.query_start_loc_cpu[-1], 4, 16, dtype=torch.float32, seed=2)
        kv = torch.zeros(query.shape[0], 2, 16, device=DEVICE)
        out = backend.forward(query, kv, kv, kv_cache, md, 0.25, attention_chunk_size=8)
        expected = reference.paged_attention(query, kv_cache, md, 0.25, attention_chunk_size=8)
        assert_close(out, expected, ATTENTION_TOL[torch.float32])
        assert not torch.allclose(out, reference.paged_attention(query, kv_cache, md, 0.25), atol=1e-3)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_padding_rows_read_and_write_nothing(index_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past ``query_start_loc[-1]`` keep what the output held (here a sentinel); int64 metadata too."""
    md, query, kv_cache = _decode_step([3, 17, 33], 4, 2, 16, 8, torch.float32, padding=3)
    md = dataclasses.replace(md, query_start_loc=md.query_start_loc.to(index_dtype),
                             seq_lens=md.seq_lens.to(index_dtype), block_tables=md.block_tables.to(index_dtype))
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, SENTINEL, **kw))
    out = _decode(query, kv_cache, md, num_segments=2)
    expected = reference.paged_attention(query, kv_cache, md, 16**-0.5)
    assert_close(out[:3], expected[:3], ATTENTION_TOL[torch.float32])
    assert (out[3:] == SENTINEL).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_equals_unified_kernel(dtype: torch.dtype) -> None:
    md, query, kv_cache = _decode_step(LENGTHS, 4, 2, 64, 16, dtype)
    split = _decode(query, kv_cache, md, num_segments=8)
    unified = paged_attention(query, kv_cache[0], kv_cache[1], md.query_start_loc, md.seq_lens, md.block_tables,
                              64**-0.5, tile_n=16)
    assert_close(split, unified, ATTENTION_TOL[dtype])


def test_split_kv_segments_policy() -> None:
    """Split only small decode-only steps; enough segments to give 2 programs per SM, at most 16."""
    assert split_kv_segments(1, 1, 8, 132) == 16  # batch 1, Qwen3-0.6B / Llama-3.1-8B on an H100
    assert split_kv_segments(8, 8, 8, 132) == 8  # 64 programs -> 512
    assert split_kv_segments(16, 16, 8, 132) == 4  # 128 programs -> 512
    assert split_kv_segments(17, 17, 8, 132) == 0  # 136 programs already fill the SMs: unified
    assert split_kv_segments(7, 4, 8, 132) == 0  # a prefill chunk or a mixed step: unified
    assert split_kv_segments(4, 4, 8, 132) == 16  # a CUDA-graph batch padded to 4 (its rows count)


def test_backend_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend runs the split kernels for a decode batch and the unified kernel for a mixed step."""
    calls = []
    for name in ("paged_decode", "paged_attention"):
        kernel = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name,
                            lambda *a, _name=name, _kernel=kernel, **kw: calls.append(_name) or _kernel(*a, **kw))
    backend = TritonBackend()
    for requests in ([(16, 1), (3, 1)], [(16, 1), (0, 3)]):
        md = _metadata(requests, 4, seed=0)
        kv_cache = randn(2, int(md.block_tables.max()) + 2, 4, 2, 16, dtype=torch.float32, seed=1)
        md.slot_mapping = torch.full((md.query_start_loc_cpu[-1],), -1, dtype=torch.int64, device=DEVICE)
        query = randn(md.query_start_loc_cpu[-1], 4, 16, dtype=torch.float32, seed=2)
        kv = torch.zeros(query.shape[0], 2, 16, device=DEVICE)
        out = backend.forward(query, kv, kv, kv_cache, md, 0.25)
        assert_close(out, reference.paged_attention(query, kv_cache, md, 0.25), ATTENTION_TOL[torch.float32])
    assert calls == ["paged_decode", "paged_attention"]


def test_launcher_rejects_bad_arguments() -> None:
    md, query, kv_cache = _decode_step([3, 5], 2, 1, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="one query row per request"):
        _decode(query[:1], kv_cache, md, 2)
    with pytest.raises(ValueError, match="num_segments"):
        _decode(query, kv_cache, md, 3)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        _decode(query, kv_cache.expand(2, -1, -1, 3, -1).contiguous(), md, 2)
    with pytest.raises(ValueError, match="attention_chunk_size must be >= 1"):
        _decode(query, kv_cache, md, 2, chunk=0)
    with pytest.raises(ValueError, match="not both"):
        _decode(query, kv_cache, md, 2, window=4, chunk=8)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(16, 8), (32, 8)])  # Qwen3-0.6B, Llama-3.1-8B
@pytest.mark.parametrize("lengths", [[640], [4096], [4096, 640, 1, 2000]])
def test_real_shapes(num_heads: int, num_kv_heads: int, lengths: list[int], dtype: torch.dtype) -> None:
    num_segments = split_kv_segments(len(lengths), len(lengths), num_kv_heads, 132)
    _check(lengths, num_heads, num_kv_heads, 128, 16, dtype, num_segments=num_segments, tile_n=None)


@pytest.mark.gpu
@requires_gpu
def test_cuda_graph_replay_follows_new_lengths() -> None:
    """Captured once, a replay with other seq_lens re-cuts the segments on the device (bfloat16 tolerance)."""
    dtype, rng = torch.bfloat16, random.Random(0)
    md, query, kv_cache = _decode_step([4096, 640, 1, 300], 32, 8, 128, 16, dtype, padding=4)
    _decode(query, kv_cache, md, num_segments=4, tile_n=None)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode(query, kv_cache, md, num_segments=4, tile_n=None)
    for _ in range(3):
        md.seq_lens[:4].copy_(torch.tensor([rng.randint(1, 4096) for _ in range(3)] + [640]))
        graph.replay()
        md_now = dataclasses.replace(md, seq_lens_cpu=md.seq_lens.tolist())
        expected = reference.paged_attention(query, kv_cache, md_now, 128**-0.5)
        assert_close(out[:4], expected[:4], ATTENTION_TOL[dtype])
