"""Storing values into an fp8 KV cache from a Triton kernel (internal).

`to_storage(x, dtype)` is ``x.to(dtype)`` for the activation dtypes. For the fp8
types (float8_e4m3fn: ``tl.float8e4nv``, float8_e5m2: ``tl.float8e5``) it first
rounds x in float32 to the nearest fp8 value (ties to even) and saturates at the
largest finite one, so the cast that follows is exact on every target and equals
torch's ``x.clamp(-max, max).to(dtype)`` (`asyncllm.kernels.reference.write_kv_cache`)
bit for bit for finite and infinite values (a NaN is stored as a NaN, its bits the target's), as vLLM's
saturating conversion. Rounding first matters for Triton's
CPU interpreter, whose fp8 downcast rounds half up and drops the carry into the
exponent (1.94 becomes 1.0); on a GPU the rounding is a few float32 operations
per stored element, and the hardware cast then has nothing left to round.

The rounding adds ``2^(e - m + 23)`` (e: the value's exponent, at least the
format's smallest normal one; m: its mantissa bits) and subtracts it again: the
float32 sum has a unit in the last place of ``2^(e - m)``, the fp8 spacing there,
and float32 addition rounds to nearest even. The sign is then or-ed in as a bit, not
negated: Triton 3.6 compiles a float ``-x`` as ``0.0 - x``, which is +0.0 for 0.0, so a
negative value that rounds to zero (-0.0 among them) was stored as 0x00 where torch
stores 0x80 (the H200 run of 2026-11-29, docs/benchmarks.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["round_to_fp8", "to_storage"]


@triton.jit
def round_to_fp8(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX_VALUE: tl.constexpr):
    """float32 x rounded to the fp8 grid (nearest, ties to even) and saturated at +-MAX_VALUE; still float32."""
    magnitude = tl.minimum(tl.abs(x), MAX_VALUE)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)  # subnormals have the smallest normal's spacing
    magic = ((exponent + (150 - MANTISSA_BITS)) << 23).to(tl.float32, bitcast=True)  # 2^(e - m + 23)
    rounded = (magnitude + magic) - magic
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000  # -0.0's too: a bit, not a negation (module doc)
    rounded = (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)  # NaN stays NaN


@triton.jit
def to_storage(x, dtype):
    """x cast to a cache's element type ``dtype``; fp8 rounded to nearest even and saturated first."""
    if dtype == tl.float8e4nv:
        x = round_to_fp8(x.to(tl.float32), 3, -6, 448.0)
    elif dtype == tl.float8e5:
        x = round_to_fp8(x.to(tl.float32), 2, -14, 57344.0)
    return x.to(dtype)
