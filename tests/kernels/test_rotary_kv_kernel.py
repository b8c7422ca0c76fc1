"""Triton rotary embedding fused with the KV-cache write (and, for Qwen3, with the per-head q/k
RMSNorm before it), against `reference.norm_and_rotate` followed by `reference.write_kv_cache`."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.metadata import RotaryInputs
from asyncllm.kernels import reference
from asyncllm.kernels.rotary_kv import rotary_embedding_with_kv_cache
from kernel_testing import DEVICE, DTYPES, ELEMENTWISE_TOL, assert_close, randn, requires_gpu


def _cos_sin_cache(rotary_dim: int, max_position: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    return reference.build_cos_sin_cache(1.0 / (10000.0**exponents), 1.0, max_position).to(DEVICE)


def _assert_rounding_close(
    actual: torch.Tensor, expected: torch.Tensor, rotated_from: torch.Tensor, qk_norm: bool
) -> None:
    """Each element within one unit in the last place at the scale of its two products
    (|x| + |rotate_half(x)|: a sum that cancels keeps the products' rounding error), and at least
    99% of elements bit-equal (torch and the kernel round the same two products; on an H100,
    2026-11-22, a value tolerance failed on 6 of 16.7 million fp16 elements, where the sum cancels).

    With the q/k norm in front, the float32 statistics (sum of squares in another order, the GPU's
    approximate rsqrt) differ from torch's by a few float32 units: rarely enough to move a half-type
    normed element by one unit, so two units at the same scale, still 99% bit-equal (emulated in torch
    at Qwen3-0.6B's shape: at most 1.5 units, 99.98% equal); in float32 every element carries them,
    so eight units and no bit-equality (emulated: at most 4.1 units, 20% equal)."""
    dtype = rotated_from.dtype
    ulps = (8 if dtype == torch.float32 else 2) if qk_norm else 1
    eps = ulps * torch.finfo(dtype).eps
    scale = rotated_from.float().abs() + reference.rotate_half(rotated_from.float()).abs()
    diff = (actual.float() - expected.float()).abs()
    assert bool((diff <= eps * scale).all()), float((diff - eps * scale).max())
    if not (qk_norm and dtype == torch.float32):
        assert float((diff == 0).float().mean()) >= 0.99, float((diff == 0).float().mean())




def rotary_step(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    scale: float, padding: int,
) -> tuple[torch.Tensor, ...]:
    """One step's inputs: the fused qkv output and q, k, v as strided views of it (as the model hands them
    over), slots shuffled over a cache of ``num_blocks`` blocks (the last ``padding`` tokens get -1), positions.
    Returns (qkv, query, key, value, slots, positions, num_blocks)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=0, scale=scale)
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    num_blocks = num_tokens // block_size + 3
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[num_tokens - padding :] = -1
    positions = torch.randint(0, 500, (num_tokens,), generator=gen).to(DEVICE)
    return qkv, query, key, value, slots.to(DEVICE), positions, num_blocks


def _run(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, block_size: int,
    dtype: torch.dtype, padding: int = 0, ulp_check: bool = False, qk_norm: bool = False,
) -> None:
    """q, k, v are strided views of one fused qkv output, as the model hands them over;
    slots are shuffled over the cache, the last ``padding`` tokens get slot -1. With ``qk_norm``
    each q and k head is RMS-normalised first (Qwen3's eps, 1e-6)."""
    _, query, key, value, slots, positions, num_blocks = rotary_step(
        num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, 2.0, padding)
    cos_sin = _cos_sin_cache(rotary_dim, 512)
    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2)
    expected_cache = kv_cache.clone()

    rotary = RotaryInputs(positions, cos_sin)
    if qk_norm:
        q_weight, k_weight = (randn(head_dim, dtype=dtype, seed=seed, scale=0.5) + 1 for seed in (6, 7))  # ~ trained
        rotary = RotaryInputs(positions, cos_sin, q_weight, k_weight, 1e-6)
    query_out = rotary_embedding_with_kv_cache(query, key, value, positions, cos_sin, kv_cache[0], kv_cache[1], slots,
                                               rotary.q_norm_weight, rotary.k_norm_weight, rotary.norm_eps)

    expected_query, expected_key = reference.norm_and_rotate(query, key, rotary)
    reference.write_kv_cache(expected_key, value, expected_cache, slots)
    if qk_norm:  # the rotation's inputs, for the unit-in-the-last-place scale
        query = reference.rms_norm(query, rotary.q_norm_weight, rotary.norm_eps)
        key = reference.rms_norm(key, rotary.k_norm_weight, rotary.norm_eps)
    assert query_out.shape == query.shape and query_out.is_contiguous()
    if ulp_check:  # millions of elements: a tolerance in units in the last place, not in values
        real = slots >= 0
        written = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots[real]]
        _assert_rounding_close(query_out, expected_query, query, qk_norm)
        _assert_rounding_close(written, expected_key[real], key[real], qk_norm)
        untouched = torch.ones(kv_cache[0].numel() // (num_kv_heads * head_dim), dtype=torch.bool, device=DEVICE)
        untouched[slots[real]] = False
        assert torch.equal(kv_cache[0].reshape(-1, num_kv_heads, head_dim)[untouched],
                           expected_cache[0].reshape(-1, num_kv_heads, head_dim)[untouched])
        assert torch.equal(kv_cache[1], expected_cache[1])
        return
    assert_close(query_out, expected_query, ELEMENTWISE_TOL[dtype])
    assert_close(kv_cache, expected_cache, ELEMENTWISE_TOL[dtype])  # padding slots and other blocks untouched
    assert torch.equal(kv_cache[1], expected_cache[1])  # values are copied, not computed


SHAPES = pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, block_size",
    [
        (5, 4, 2, 64, 64, 4),
        (13, 6, 2, 24, 24, 16),  # head dim not a power of two, 3 queries per KV head
        (7, 3, 1, 128, 128, 8),
        (9, 4, 4, 32, 16, 4),  # partial rotary: dims 16..31 pass through
        (6, 5, 1, 40, 24, 4),  # partial rotary at a head dim not a power of two, 5 queries per KV head
    ],
)


@pytest.mark.parametrize("dtype", DTYPES)
@SHAPES
def test_rotary_kv_matches_reference(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, block_size: int,
    dtype: torch.dtype,
) -> None:
    _run(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, block_size, dtype, padding=2)


@pytest.mark.parametrize("dtype", DTYPES)
@SHAPES
def test_fused_qk_norm_matches_reference(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, block_size: int,
    dtype: torch.dtype,
) -> None:
    """Qwen3's per-head q/k RMSNorm fused in: the same tolerance as the rotation alone (the norm rounds
    like `reference.rms_norm`; only its float32 sum of squares may add in another order)."""
    _run(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, block_size, dtype, padding=2, qk_norm=True)


def test_launcher_rejects_bad_arguments() -> None:
    q, k = randn(3, 4, 16, dtype=torch.float32, seed=3), randn(3, 2, 16, dtype=torch.float32, seed=4)
    cache = randn(2, 4, 4, 2, 16, dtype=torch.float32, seed=5)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin_cache(16, 8)
    with pytest.raises(ValueError, match="rotary dim"):
        rotary_embedding_with_kv_cache(q, k, k, positions, _cos_sin_cache(32, 8), cache[0], cache[1], positions)
    with pytest.raises(ValueError, match="key_cache must be"):
        rotary_embedding_with_kv_cache(q, k, k, positions, cos_sin, cache[0, :, :, :1], cache[1, :, :, :1], positions)
    with pytest.raises(ValueError, match="positions must be an integer"):
        rotary_embedding_with_kv_cache(q, k, k, positions[:2], cos_sin, cache[0], cache[1], positions)
    strided = torch.zeros(6, dtype=torch.int64, device=DEVICE)[::2]
    with pytest.raises(ValueError, match=r"slot_mapping must be contiguous \(stride 1\)"):
        rotary_embedding_with_kv_cache(q, k, k, positions, cos_sin, cache[0], cache[1], strided)


@pytest.mark.parametrize(
    "weights, eps, message",
    [
        ((16, None), 1e-6, "go together"),  # one norm without the other
        ((16, 16), None, "go together"),  # weights without eps
        ((8, 16), 1e-6, r"q_norm_weight must be a contiguous \[16\]"),
        ((16, "fp16"), 1e-6, "k_norm_weight dtype"),
    ],
)
def test_launcher_rejects_bad_norm_arguments(weights: tuple, eps: float | None, message: str) -> None:
    q, k = randn(3, 4, 16, dtype=torch.float32, seed=3), randn(3, 2, 16, dtype=torch.float32, seed=4)
    cache = randn(2, 4, 4, 2, 16, dtype=torch.float32, seed=5)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)

    def weight(spec: int | str | None) -> torch.Tensor | None:
        if spec is None:
            return None
        return randn(16, dtype=torch.float16, seed=6) if spec == "fp16" else randn(spec, dtype=torch.float32, seed=6)

    with pytest.raises(ValueError, match=message):
        rotary_embedding_with_kv_cache(q, k, k, positions, _cos_sin_cache(16, 8), cache[0], cache[1], positions,
                                       weight(weights[0]), weight(weights[1]), eps)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, qk_norm",
    [(16, 8, 128, True), (16, 8, 128, False), (32, 8, 128, False)],  # Qwen3-0.6B (with and without), Llama-3.1-8B
)
def test_rotary_kv_real_shapes(num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool,
                               dtype: torch.dtype) -> None:
    _run(4096, num_heads, num_kv_heads, head_dim, head_dim, 16, dtype, padding=7, ulp_check=True, qk_norm=qk_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_kv_ulp_check_on_a_small_shape(qk_norm: bool, dtype: torch.dtype) -> None:
    """The real-shape test's unit-in-the-last-place check, run where CI can (the interpreter)."""
    _run(11, 4, 2, 64, 64, 4, dtype, padding=3, ulp_check=True, qk_norm=qk_norm)
