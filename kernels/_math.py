"""Elementwise math the kernels share, written with `tl.exp` only so that it runs the same compiled and
under Triton's interpreter (which lacks the CUDA libdevice functions)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tanh", "softcap"]


@triton.jit
def tanh(x):
    """``tanh(x)`` in float32 as ``2 / (1 + exp(-2x)) - 1``, x clamped to +-15 (where tanh is +-1 in float32)
    so exp never overflows; an absolute error of a few float32 ulps of 1 near 0."""
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def softcap(scores, cap):
    """Gemma 2's attention-score cap, ``cap * tanh(scores / cap)`` (transformers' order)."""
    return tanh(scores / cap) * cap
