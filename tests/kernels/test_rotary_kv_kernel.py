"""Triton rotary embedding fused with the KV-cache write, against `reference.apply_rotary`
followed by `reference.write_kv_cache`."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.rotary_kv import rotary_embedding_with_kv_cache
from kernel_testing import DEVICE, DTYPES, ELEMENTWISE_TOL, assert_close, randn, requires_gpu


def _cos_sin_cache(rotary_dim: int, max_position: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return reference.build_cos_sin_cache(1.0 / (10000.0**exponents), 1.0, max_position).to(DEVICE)


def _assert_rounding_close(actual: torch.Tensor, expected: torch.Tensor, rotated_from: torch.Tensor) -> None:
    """Each element within one unit in the last place at the scale of its two products
    (|x| + |rotate_half(x)|: a sum that cancels keeps the products' rounding error), and at least
    99% of elements bit-equal (torch and the kernel round the same two products; on an H100,
    2026-11-22, a value tolerance failed on 6 of 16.7 million fp16 elements, where the sum cancels)."""
    eps = torch.finfo(rotated_from.dtype).eps
    scale = rotated_from.float().abs() + reference.rotate_half(rotated_from.float()).abs()
    diff = (actual.float() - expected.float()).abs()
    assert bool((diff <= eps * scale).all()), float((diff - eps * scale).max())
    assert float((diff == 0).float().mean()) >= 0.99, float((diff == 0).float().mean())


def _run(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, block_size: int,
    dtype: torch.dtype, padding: int = 0, ulp_check: bool = False,
) -> None:
    """q, k, v are strided views of one fused qkv output, as the model hands them over;
    slots are shuffled over the cache, the last ``padding`` tokens get slot -1."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=0, scale=2.0)
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    num_blocks = num_tokens // block_size + 3
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[num_tokens - padding :] = -1
    slots = slots.to(DEVICE)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen).to(DEVICE)
    cos_sin = _cos_sin_cache(rotary_dim, 512)
    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    expected_cache = kv_cache.clone()

    query_out = rotary_embedding_with_kv_cache(query, key, value, positions, cos_sin, kv_cache[0], kv_cache[1], slots)

    expected_query, expected_key = reference.apply_rotary(query, key, positions, cos_sin)
    reference.write_kv_cache(expected_key, value, expected_cache, slots)
    assert query_out.shape == query.shape and query_out.is_contiguous()
    if ulp_check:  # millions of elements: a tolerance in units in the last place, not in values
        real = slots >= 0
        written = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots[real]]
        _assert_rounding_close(query_out, expected_query, query)
        _assert_rounding_close(written, expected_key[real], key[real])
        untouched = torch.ones(kv_cache[0].numel() // (num_kv_heads * head_dim), dtype=torch.bool, device=DEVICE)
        untouched[slots[real]] = False
        assert torch.equal(kv_cache[0].reshape(-1, num_kv_heads, head_dim)[untouched],
                           expected_cache[0].reshape(-1, num_kv_heads, head_dim)[untouched])
        assert torch.equal(kv_cache[1], expected_cache[1])
        return
    assert_close(query_out, expected_query, ELEMENTWISE_TOL[dtype])
    assert_close(kv_cache, expected_cache, ELEMENTWISE_TOL[dtype])  # padding slots and other blocks untouched
    assert torch.equal(kv_cache[1], expected_cache[1])  # values are copied, not computed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, block_size",
    [
        (5, 4, 2, 64, 64, 4),
        (13, 6, 2, 24, 24, 16),  # head dim not a power of two, 3 queries per KV head
        (7, 3, 1, 128, 128, 8),
        (9, 4, 4, 32, 16, 4),  # partial rotary: dims 16..31 pass through
    ],
)
def test_rotary_kv_matches_reference(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, block_size: int,
    dtype: torch.dtype,
) -> None:
    _run(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, block_size, dtype, padding=2)


def test_launcher_rejects_bad_arguments() -> None:
    q, k = randn(3, 4, 16, dtype=torch.float32, seed=3), randn(3, 2, 16, dtype=torch.float32, seed=4)
    cache = randn(2, 4, 4, 2, 16, dtype=torch.float32, seed=5)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin_cache(16, 8)
    with pytest.raises(ValueError, match="rotary dim"):
        rotary_embedding_with_kv_cache(q, k, k, positions, _cos_sin_cache(32, 8), cache[0], cache[1], positions)
    with pytest.raises(ValueError, match="key_cache must be"):
        rotary_embedding_with_kv_cache(q, k, k, positions, cos_sin, cache[0, :, :, :1], cache[1, :, :, :1], positions)
    with pytest.raises(ValueError, match="positions and slot_mapping must be"):
        rotary_embedding_with_kv_cache(q, k, k, positions[:2], cos_sin, cache[0], cache[1], positions)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(16, 8, 128), (32, 8, 128)])  # Qwen3-0.6B, Llama-3.1-8B
def test_rotary_kv_real_shapes(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    _run(4096, num_heads, num_kv_heads, head_dim, head_dim, 16, dtype, padding=7, ulp_check=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kv_ulp_check_on_a_small_shape(dtype: torch.dtype) -> None:
    """The real-shape test's unit-in-the-last-place check, run where CI can (the interpreter)."""
    _run(11, 4, 2, 64, 64, 4, dtype, padding=3, ulp_check=True)
