"""Triton paged KV-cache write: keys (and values) stored at their tokens' slots, with no rotation.

The triton backend's write for the layers the fused `asyncllm.kernels.rotary_kv` kernel does not serve: ALiBi
layers (BLOOM, MPT, Falcon-RW: no rotary) and latent attention's one-part cache (DeepSeek-V2/V3, MiniCPM3: no
values, the keys are the values). Grid ``(num_tokens, num_kv_heads)``: program (t, h) stores token t's head h at
its slot (``block = slot // block_size``, ``offset = slot % block_size``); a negative slot is padding and is not
stored. The padding is skipped on the device, so the write never reads the slots on the host: it can be captured
in a CUDA graph (whose padded rows carry slot -1) and never stalls the overlapped step pipeline, where torch's
boolean-mask select of the valid rows (`asyncllm.kernels.reference.write_kv_cache`, the reference) waits for the
GPU.

Values are stored as the cache's element type: an fp8 cache holds the nearest fp8 value, saturated
(`asyncllm.kernels._fp8.to_storage`), which is the reference's cast bit for bit; others cast as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import (
    check, check_float, check_kv_cache, check_last_dim_contiguous, check_same_device, check_token_vector,
)
from asyncllm.kernels._kv_cache import copy_to_cache, slot_offset
from asyncllm.kernels._pdl import pdl_enter, pdl_launch

__all__ = ["write_kv_cache"]


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_token_stride, k_head_stride, v_token_stride, v_head_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride,
    head_dim, block_size,
    HEAD_DIM: tl.constexpr, HAS_VALUE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid ``(num_tokens, num_kv_heads)``: token t's head h (key, and value when given) at its slot, unless
    the slot is negative."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        dims = tl.arange(0, HEAD_DIM)
        mask = dims < head_dim
        cache_offset = slot_offset(slot, block_size, cache_block_stride, cache_slot_stride) + head * cache_head_stride
        copy_to_cache(k_ptr + token * k_token_stride + head * k_head_stride + dims, k_cache_ptr + cache_offset + dims,
                      mask)
        if HAS_VALUE:
            copy_to_cache(v_ptr + token * v_token_stride + head * v_head_stride + dims,
                          v_cache_ptr + cache_offset + dims, mask)


def _check_args(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    check_kv_cache("kv_cache", kv_cache, 5)
    check_last_dim_contiguous("kv_cache", kv_cache)
    check((value is None) == (kv_cache.shape[0] == 1) and kv_cache.shape[0] in (1, 2),
          "values go to a two-part cache [2, ...], none to a one-part cache [1, ...]")
    for name, t in (("key", key), ("value", value)):
        if t is not None:
            check_float(name, t, 3)
            check(tuple(t.shape) == (key.shape[0], *kv_cache.shape[-2:]),
                  f"{name} {tuple(t.shape)} must be [T, Hkv, D] of the cache's {tuple(kv_cache.shape[-2:])}")
            check_last_dim_contiguous(name, t)
            check_same_device(**{name: t}, kv_cache=kv_cache)
    check(kv_cache.dtype == key.dtype or kv_cache.dtype.itemsize == 1,
          f"the KV cache must be of the key's dtype {key.dtype} or an fp8 type, got {kv_cache.dtype}")
    check(value is None or value.dtype == key.dtype, "key and value must share a dtype")
    check_token_vector("slot_mapping", slot_mapping, key.shape[0])
    check_same_device(key=key, slot_mapping=slot_mapping)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store key, value ``[T, Hkv, D]`` into ``kv_cache [2, num_blocks, block_size, Hkv, D]`` at their slots, cast
    to the cache's dtype; ``value`` None: a one-part cache ``[1, ...]`` (latent attention). A negative slot is not
    written. `asyncllm.kernels.reference.write_kv_cache`'s signature and results, without a host sync."""
    _check_args(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[-1]  # a one-part cache: the same part (its keys are its values)
    values = key if value is None else value  # unread without values
    _kv_write_kernel[(num_tokens, num_kv_heads)](
        key, values, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), values.stride(0), values.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        head_dim, key_cache.shape[1],
        HEAD_DIM=triton.next_power_of_2(head_dim), HAS_VALUE=value is not None, num_warps=4,
        **pdl_launch(key.device),
    )
