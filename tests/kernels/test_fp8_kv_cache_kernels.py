"""The Triton kernels over an fp8 KV cache (kv_cache_dtype='fp8' / 'fp8_e5m2', scale 1.0).

The KV write must store exactly the fp8 value of what it stores in a cache of the activation
dtype (rounded to nearest even, saturated: `reference.to_kv_cache_dtype`), and the attention
kernels must equal the torch reference computed on the fp8-rounded K/V upcast, within the
ordinary attention tolerances (the upcast is exact, so fp8 adds no error of its own there).
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention_kernel import MIXED_STEP, _metadata
from test_paged_decode_kernel import LENGTHS, _decode, _decode_step
from test_rotary_kv_kernel import _cos_sin_cache, rotary_step

from asyncllm.attention.metadata import RotaryInputs
from asyncllm.attention.triton import TritonBackend
from asyncllm.kernels import reference
from asyncllm.kernels.paged_attention import paged_attention
from asyncllm.kernels.rotary_kv import rotary_embedding_with_kv_cache
from kernel_testing import ATTENTION_TOL, DEVICE, assert_close, randn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = pytest.mark.parametrize(  # each fp8 type under each activation dtype, half the product (interpreter time)
    "dtype, fp8", [(torch.float32, E4M3), (torch.float16, E4M3), (torch.float16, E5M2), (torch.float32, E5M2)],
    ids=["fp32-e4m3", "fp16-e4m3", "fp16-e5m2", "fp32-e5m2"],
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _to_fp8(t: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    return reference.to_kv_cache_dtype(t, fp8)


def _assert_rounded(stored: torch.Tensor, source: torch.Tensor) -> None:
    """stored (fp8) holds the nearest-even, saturated fp8 value of every source value, bit for bit. The
    reference cast runs on the CPU (the rule `test_fp8_rounding_is_nearest_even_and_saturating` pins down);
    a failure names the first differing values."""
    stored, expected = stored.cpu(), _to_fp8(source.cpu(), stored.dtype)
    differ = (_bits(stored) != _bits(expected)).nonzero()
    found = [(tuple(i.tolist()), float(source.cpu()[tuple(i)]), float(stored[tuple(i)]), float(expected[tuple(i)]))
             for i in differ[:8]]
    assert not found, f"{len(differ)} of {stored.numel()} differ: (index, source, stored, nearest even) {found}"


def test_fp8_rounding_is_nearest_even_and_saturating() -> None:
    """The reference cast the kernels must reproduce: ties to even, +-max beyond the range."""
    e4m3 = _to_fp8(torch.tensor([1.0625, 1.1875, 1.94, 460.0, -1e6, 2.0**-10]), torch.float8_e4m3fn).float()
    assert e4m3.tolist() == [1.0, 1.25, 2.0, 448.0, -448.0, 0.0]  # 2^-10 is below half the subnormal step 2^-9
    e5m2 = _to_fp8(torch.tensor([1.125, 1.375, 1e6]), torch.float8_e5m2).float()
    assert e5m2.tolist() == [1.0, 1.5, 57344.0]


@pytest.mark.parametrize("dtype, fp8, qk_norm", [(torch.float32, E4M3, False), (torch.float16, E4M3, True),
                                               (torch.float16, E5M2, False), (torch.float32, E5M2, True)],
                         ids=["fp32-e4m3", "fp16-e4m3-qk_norm", "fp16-e5m2", "fp32-e5m2-qk_norm"])
def test_rotary_kv_write_stores_the_fp8_value(fp8: torch.dtype, dtype: torch.dtype, qk_norm: bool) -> None:
    """Two launches on the same inputs, one into a cache of the activation dtype, one into an fp8 cache:
    the fp8 cache holds exactly the other's values cast to fp8 (bit for bit, every slot: written, padding
    and untouched), the values are the reference's ``v.to(fp8)``, and the rotated query is unchanged."""
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, block_size = 13, 6, 2, 40, 24, 4  # partial rotary
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv, query, key, value, slots, positions, num_blocks = rotary_step(
        num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, 3.0, padding=2)
    extremes = torch.tensor([65504.0, -65504.0, 0.0, -0.0], dtype=dtype)  # saturated; the sign of zero kept
    qkv[0, q_size + rotary_dim : q_size + rotary_dim + 4] = extremes  # a key's pass-through dims (through the views)
    qkv[0, q_size + kv_size : q_size + kv_size + 4] = extremes  # a value
    cos_sin = _cos_sin_cache(rotary_dim, 512)
    norm = (randn(head_dim, dtype=dtype, seed=6, scale=0.5) + 1, randn(head_dim, dtype=dtype, seed=7, scale=0.5) + 1,
            1e-6) if qk_norm else (None, None, None)
    full_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    fp8_cache = _to_fp8(full_cache, fp8)
    untouched = fp8_cache.clone()  # random everywhere: a write to a wrong slot shows

    q_full = rotary_embedding_with_kv_cache(query, key, value, positions, cos_sin, full_cache[0], full_cache[1],
                                            slots, *norm)
    q_fp8 = rotary_embedding_with_kv_cache(query, key, value, positions, cos_sin, fp8_cache[0], fp8_cache[1],
                                           slots, *norm)
    assert fp8_cache.dtype == fp8 and torch.equal(q_fp8, q_full)
    _assert_rounded(fp8_cache, full_cache)
    expected = untouched.clone()  # values are copied: the reference write gives the same bits
    reference.write_kv_cache(key, value, expected, slots)
    assert torch.equal(_bits(fp8_cache[1]), _bits(expected[1]))
    _, ref_key = reference.norm_and_rotate(query, key, RotaryInputs(positions, cos_sin, *norm))
    reference.write_kv_cache(ref_key, value, expected, slots)  # the torch path: one fp8 unit apart at most
    e4m3 = fp8 == E4M3
    assert_close(fp8_cache[0], expected[0], (2.0 ** (-9 if e4m3 else -16), 2.0 ** (-3 if e4m3 else -2)))
    limit = torch.finfo(fp8).max
    stored_k, stored_v = (fp8_cache[i].reshape(-1, num_kv_heads, head_dim)[slots[0], 0] for i in (0, 1))
    assert stored_v[:4].float().tolist() == [limit, -limit, 0.0, 0.0] and int(_bits(stored_v)[3]) == 0x80
    if not qk_norm:  # pass-through dims are stored as they come (the norm would rescale them)
        assert stored_k[rotary_dim : rotary_dim + 4].float().tolist() == [limit, -limit, 0.0, 0.0]


def _fp8_attention_inputs(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, fp8):
    metadata = _metadata(requests, block_size, seed=num_heads * head_dim)
    num_blocks = int(metadata.block_tables.max()) + 2
    full_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=1)
    query = randn(metadata.query_start_loc_cpu[-1], num_heads, head_dim, dtype=dtype, seed=2, scale=2.0)
    return metadata, query, full_cache, _to_fp8(full_cache, fp8)


@PAIRS
def test_paged_attention_over_fp8_cache(dtype: torch.dtype, fp8: torch.dtype) -> None:
    """A decode, a chunk over a cached prefix, a fresh prefill and an empty query in one step, over an fp8 cache:
    the reference on the rounded K/V within the attention tolerance, and measurably off the unrounded one."""
    num_heads, num_kv_heads, head_dim, block_size = (4, 2, 64, 16) if fp8 == E4M3 else (6, 2, 24, 8)  # GQA 2:1, 3:1
    md, query, full_cache, fp8_cache = _fp8_attention_inputs(MIXED_STEP, num_heads, num_kv_heads, head_dim,
                                                             block_size, dtype, fp8)
    scale = head_dim**-0.5
    out = paged_attention(query, fp8_cache[0], fp8_cache[1], md.query_start_loc, md.seq_lens, md.block_tables,
                          scale, tile_n=16)
    expected = reference.paged_attention(query, fp8_cache.to(dtype), md, scale)
    assert out.dtype == dtype
    assert_close(out, expected, ATTENTION_TOL[dtype])
    assert_close(reference.paged_attention(query, fp8_cache, md, scale), expected, (0.0, 0.0))  # upcast inside
    unrounded = reference.paged_attention(query, full_cache, md, scale)
    assert float((out.float() - unrounded.float()).abs().max()) > 10 * ATTENTION_TOL[dtype][0]


@pytest.mark.parametrize("dtype, fp8", [(torch.float32, E4M3), (torch.float16, E5M2)], ids=["fp32-e4m3", "fp16-e5m2"])
def test_paged_decode_over_fp8_cache(dtype: torch.dtype, fp8: torch.dtype) -> None:
    """The split-KV decode kernels, lengths 1 to 200 in one batch, GQA 2:1, odd head dim and block size."""
    md, query, full_cache = _decode_step(LENGTHS, 4, 2, 80, 5, dtype)
    fp8_cache = _to_fp8(full_cache, fp8)
    out = _decode(query, fp8_cache, md, num_segments=4)
    expected = reference.paged_attention(query, fp8_cache.to(dtype), md, 80**-0.5)
    assert_close(out, expected, ATTENTION_TOL[dtype])


def test_triton_backend_writes_and_reads_an_fp8_cache() -> None:
    """One layer's step through the backend (rotary + KV write, then attention) equals torch_sdpa's over
    its own fp8 cache: the caches bit-equal, the outputs within the float32 attention tolerance."""
    from asyncllm.attention.torch_sdpa import TorchSDPABackend

    requests = [(9, 1), (0, 6), (4, 3)]
    md = _metadata(requests, 4, seed=3)
    computed = [c for c, _ in requests]
    md.slot_mapping = torch.tensor([int(md.block_tables[i, (c + j) // 4]) * 4 + (c + j) % 4
                                    for i, (c, n) in enumerate(requests) for j in range(n)], device=DEVICE)
    num_tokens = md.query_start_loc_cpu[-1]
    query, key, value = (randn(num_tokens, h, 32, dtype=torch.float32, seed=s) for s, h in ((4, 4), (5, 2), (6, 2)))
    positions = torch.tensor([c + j for c, (_, n) in zip(computed, requests) for j in range(n)], device=DEVICE)
    rotary = RotaryInputs(positions, _cos_sin_cache(32, 64))
    base = _to_fp8(randn(2, int(md.block_tables.max()) + 2, 4, 2, 32, dtype=torch.float32, seed=7),
                   E4M3)
    caches = [base.clone(), base.clone()]
    outs = [backend.forward(query, key, value, cache, md, 32**-0.5, rotary=rotary)
            for backend, cache in zip((TritonBackend(), TorchSDPABackend()), caches)]
    assert torch.equal(_bits(caches[0]), _bits(caches[1]))
    assert_close(outs[0], outs[1], ATTENTION_TOL[torch.float32])


def test_launchers_refuse_a_cache_of_another_wide_dtype() -> None:
    """fp8 or the query's dtype; a float16 cache under a float32 query is a mistake, not a conversion."""
    md = _metadata([(3, 2)], 4, seed=0)
    cache = randn(2, 4, 4, 2, 16, dtype=torch.float16, seed=3)
    query = randn(2, 2, 16, dtype=torch.float32, seed=4)
    with pytest.raises(ValueError, match="query's dtype"):
        paged_attention(query, cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.25)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(query, cache[0].float(), _to_fp8(cache[1], E4M3), md.query_start_loc,
                        md.seq_lens, md.block_tables, 0.25)


def test_calibrated_scales_through_the_triton_backend_for_a_writer_and_a_reader() -> None:
    """`Attention` with calibrated scales (k_scale 0.05, v_scale 4) over an e4m3 cache: the writing layer's step
    (keys and values divided, then written) and a KV-sharing layer's over the same cache (no keys or values: the
    writer's scales on the scores and the output, asyncllm/models/kv_scales.py) through the Triton backend equal
    torch_sdpa's, the caches bit for bit."""
    from asyncllm.attention.torch_sdpa import TorchSDPABackend
    from asyncllm.models.layers import Attention

    requests = [(9, 1), (0, 6), (4, 3)]
    md = _metadata(requests, 4, seed=5)
    md.slot_mapping = torch.tensor([int(md.block_tables[i, (c + j) // 4]) * 4 + (c + j) % 4
                                    for i, (c, n) in enumerate(requests) for j in range(n)], device=DEVICE)
    num_tokens = md.query_start_loc_cpu[-1]
    query, key, value = (randn(num_tokens, h, 32, dtype=torch.float32, seed=s) for s, h in ((4, 4), (5, 2), (6, 2)))
    positions = torch.tensor([c + j for c, n in requests for j in range(n)], device=DEVICE)
    rotary = RotaryInputs(positions, _cos_sin_cache(32, 64))
    base = _to_fp8(randn(2, int(md.block_tables.max()) + 2, 4, 2, 32, dtype=torch.float32, seed=8) * 20, E4M3)
    caches, outs = [base.clone(), base.clone()], []
    for backend, cache in zip((TritonBackend(), TorchSDPABackend()), caches):
        writer, reader = Attention(4, 2, 32, backend), Attention(4, 2, 32, backend, scale=0.5)
        for attn in (writer, reader):
            attn.k_scale, attn.v_scale = 0.05, 4.0
        outs.append((writer(query, key, value, cache, md, rotary), reader(query * 0.5, None, None, cache, md)))
    assert torch.equal(_bits(caches[0]), _bits(caches[1]))
    for got, expected in zip(*outs):
        assert_close(got, expected, ATTENTION_TOL[torch.float32])
