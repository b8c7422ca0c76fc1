"""Storing into a paged KV cache from a Triton kernel (internal): a slot's row and the cast to the cache's type.

Shared by `asyncllm.kernels.rotary_kv` (rotated keys, values) and `asyncllm.kernels.kv_write` (keys and values
as they are). A cache part is ``[num_blocks, block_size, Hkv, D]``; slot s is row ``s % block_size`` of block
``s // block_size``. The slot is int64 (a large cache's offset passes 2**31 elements).
"""

from __future__ import annotations

import triton
import triton.language as tl

from asyncllm.kernels._fp8 import to_storage

__all__ = ["copy_to_cache", "slot_offset"]


@triton.jit
def slot_offset(slot, block_size, block_stride, slot_stride):
    """The element offset of (int64) ``slot``'s row in a cache part of the given block and slot strides."""
    return (slot // block_size) * block_stride + (slot % block_size) * slot_stride


@triton.jit
def copy_to_cache(src, dst, mask):
    """Load the elements at pointers ``src`` and store them at ``dst`` (a KV cache's) as its element type
    (`to_storage`: fp8 rounded to nearest even and saturated); masked lanes neither read nor written."""
    tl.store(dst, to_storage(tl.load(src, mask=mask), dst.dtype.element_ty), mask=mask)
