"""Torch references of the quantized products: block-scaled fp8 (pre-quantized checkpoints, static fp8 activations)
and integer weight-only (AWQ / GPTQ). Part of `asyncllm.kernels.reference`, which re-exports every name: tests and
kernels use them as ``reference.X``; this module holds them apart only to keep that one file's size in bounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FP8_E4M3_MAX", "FP8_MIN_SCALE", "expand_block_scales", "per_token_group_quant_fp8", "static_quant_fp8",
           "dequantize_fp8_blocks", "w8a8_block_fp8_matmul", "unpack_int_rows", "dequantize_int_weight", "w4a16_matmul"]


# ---------------------------------------------------------------- block-scaled fp8 (pre-quantized checkpoints)
FP8_E4M3_MAX = 448.0
"""The largest float8_e4m3fn value."""
FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)
"""The smallest scale (vLLM's ``_FP8_MIN_SCALING_FACTOR``): an all-zero group quantizes to zeros, not NaN."""


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """``scale [ceil(R/br), ceil(C/bc)]`` repeated over its ``block = (br, bc)`` cells: ``[R, C]`` (a block
    wider than the matrix repeated only over it)."""
    rows, cols = shape
    return scale.repeat_interleave(min(block[0], rows), 0)[:rows].repeat_interleave(min(block[1], cols), 1)[:, :cols]


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 scales ``[M, ceil(K / group_size)]``).

    Each row's features in consecutive groups of ``group_size`` (the last may be shorter) get one scale,
    ``max|group| / 448`` (at least `FP8_MIN_SCALE`), and are stored as ``fp8(clamp(x / scale, -448, 448))``,
    rounded to nearest even, in float32. A group of at least K features is one scale per row."""
    num_rows, k = x.shape
    group_size = max(1, min(group_size, k))
    groups = -(-k // group_size)
    grouped = F.pad(x.float(), (0, groups * group_size - k)).view(num_rows, groups, group_size)
    amax = grouped.abs().amax(-1, keepdim=True)  # divided by a tensor: CUDA multiplies by a number's reciprocal
    scale = (amax / amax.new_full((), FP8_E4M3_MAX)).clamp(min=FP8_MIN_SCALE)  # (`models.int8.int8_scale`)
    q = (grouped / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(num_rows, groups * group_size)[:, :k], scale.squeeze(-1)


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]``, a static per-tensor ``scale`` (float32 scalar) -> (float8_e4m3fn ``fp8(clamp(x / scale, -448,
    448))``, float32 ``[M, 1]`` all ``scale``): static fp8 activations, dense and experts'. One float32 copy."""
    q = x.to(torch.float32, copy=True).div_(scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q * scale`` in float32, each scale covering a ``block = (rows, cols)`` cell of ``q [R, C]``."""
    return q.float() * expand_block_scales(scale, tuple(q.shape), block)


def w8a8_block_fp8_matmul(
    a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, block_size: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dq(a) @ dq(b).T`` in float32, rounded once to ``out_dtype``: a ``[M, K]`` fp8 with per-token-group scales
    ``a_s [M, ceil(K/bk)]``, b ``[N, K]`` fp8 with block scales ``b_s [ceil(N/bn), ceil(K/bk)]``,
    ``block_size = (bn, bk)``."""
    block_n, block_k = block_size
    a = dequantize_fp8_blocks(a_q, a_s, (1, block_k))
    b = dequantize_fp8_blocks(b_q, b_s, (block_n, block_k))
    return (a @ b.T).to(out_dtype)


# ---------------------------------------------------------------- integer weight-only (AWQ / GPTQ checkpoints)
def unpack_int_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[K / p, N]`` (``p = 32 / bits`` values per int32 along K, the first in the lowest bits) -> int32
    ``[K, N]``, each value in ``[0, 2**bits)``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    values = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, qweight.shape[1])


def dequantize_int_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
                          bits: int, group_size: int) -> torch.Tensor:
    """``W [K, N]`` in float32: ``(q[k, n] - zeros[g, n]) * scales[g, n]`` with ``g = g_idx[k]``, or ``k //
    group_size`` without ``g_idx``; ``zeros`` are the zero points themselves (any checkpoint offset applied)."""
    q = unpack_int_rows(qweight, bits)
    groups = torch.arange(q.shape[0], device=q.device) // group_size if g_idx is None else g_idx.long()
    return (q.float() - zeros.float()[groups]) * scales.float()[groups]


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """``x [M, K] @ W`` (`dequantize_int_weight`, rounded once to x's dtype) with float32 accumulation, in x's
    dtype."""
    w = dequantize_int_weight(qweight, scales, zeros, g_idx, bits, group_size).to(x.dtype)
    return (x.float() @ w.float()).to(x.dtype)
