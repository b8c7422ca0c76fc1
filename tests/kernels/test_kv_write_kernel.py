"""Triton paged KV-cache write (ALiBi's two-part cache, latent attention's one-part cache) against
`reference.write_kv_cache`: bit for bit, padding slots (-1) written nowhere, other slots untouched."""

from __future__ import annotations

import pytest
import torch
from test_rotary_kv_kernel import rotary_step

from asyncllm.kernels import reference
from asyncllm.kernels.kv_write import write_kv_cache
from kernel_testing import DEVICE, DTYPES, randn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _run(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
         cache_dtype: torch.dtype, with_values: bool, padding: int) -> None:
    """k and v are strided views of one fused qkv output (as the model hands them over); slots shuffled over the
    cache, the last ``padding`` tokens -1. The cache starts random, so an unwritten slot must keep its bits."""
    _, _, key, value, slots, _, num_blocks = rotary_step(
        num_tokens, num_kv_heads, num_kv_heads, head_dim, block_size, dtype, 300.0, padding)  # past fp8 e4m3's max
    parts = 2 if with_values else 1
    cache = randn(parts, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=2).to(cache_dtype)
    expected = cache.clone()
    values = value if with_values else None
    write_kv_cache(key, values, cache, slots)
    reference.write_kv_cache(key, values, expected, slots)
    assert torch.equal(_bits(cache), _bits(expected))
    written = cache[0].reshape(-1, num_kv_heads, head_dim)[slots[: num_tokens - padding]]
    assert torch.equal(_bits(written), _bits(reference.to_kv_cache_dtype(key[: num_tokens - padding], cache_dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_values", [True, False], ids=["two-part", "one-part"])
@pytest.mark.parametrize(
    "num_tokens, num_kv_heads, head_dim, block_size, padding",
    [(5, 2, 64, 4, 2), (13, 3, 40, 16, 0), (6, 1, 72, 4, 6)],  # a head dim not a power of two; all padding
)
def test_kv_write_matches_reference(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                                    padding: int, with_values: bool, dtype: torch.dtype) -> None:
    _run(num_tokens, num_kv_heads, head_dim, block_size, dtype, dtype, with_values, padding)


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("with_values", [True, False], ids=["two-part", "one-part"])
def test_kv_write_stores_the_fp8_value(fp8: torch.dtype, with_values: bool) -> None:
    """An fp8 cache holds the reference's nearest-even, saturated value (keys scaled past e4m3's 448)."""
    _run(9, 2, 40, 4, torch.float16, fp8, with_values, padding=3)


def test_kv_write_rejects_bad_arguments() -> None:
    key = randn(3, 2, 16, dtype=torch.float32, seed=3)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    two_part, one_part = (randn(p, 4, 4, 2, 16, dtype=torch.float32, seed=5) for p in (2, 1))
    with pytest.raises(ValueError, match="one-part cache"):
        write_kv_cache(key, None, two_part, slots)
    with pytest.raises(ValueError, match="one-part cache"):
        write_kv_cache(key, key, one_part, slots)
    with pytest.raises(ValueError, match=r"must be \[T, Hkv, D\]"):
        write_kv_cache(key[:, :1], None, one_part, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, None, one_part, slots[:2])
    with pytest.raises(ValueError, match="the KV cache must be of the key's dtype"):
        write_kv_cache(key.half(), None, one_part, slots)
    strided = torch.zeros(6, dtype=torch.int64, device=DEVICE)[::2]  # the kernel reads slot t at slot_mapping + t
    with pytest.raises(ValueError, match=r"slot_mapping must be contiguous \(stride 1\)"):
        write_kv_cache(key, None, one_part, strided)
