"""Triton RMSNorm, optionally fused with the residual add before it.

Same rounding as `asyncllm.kernels.reference.rms_norm` (HF's): the residual
sum is rounded to the activation dtype, statistics are taken in float32, the
normalised row is rounded to the dtype before the weight multiplies it. One
program per row; the whole row sits in registers (hidden sizes up to 64K).

The ``gemma_`` pair is Gemma's norm (`reference.gemma_rms_norm`): the weight is an
offset from 1 and the row is rounded once, after ``(1 + weight)`` multiplies it in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check, check_float, check_last_dim_contiguous, check_same_device
from asyncllm.kernels._pdl import pdl_enter, pdl_launch

__all__ = ["rms_norm", "fused_add_rms_norm", "gemma_rms_norm", "gemma_fused_add_rms_norm"]

_MAX_BLOCK = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    x_stride, residual_stride, out_stride, residual_out_stride,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GEMMA: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + residual).to(dtype)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = x * tl.rsqrt(variance + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        out = normed * (1.0 + weight)
    else:
        out = weight * normed.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(dtype), mask=mask)


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, hidden]`` (a view when the leading dims allow it)."""
    check(x.dim() >= 1, f"{name} must have at least 1 dim")
    check_last_dim_contiguous(name, x)
    return x.reshape(-1, x.shape[-1])


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_float("x", x, x.dim())
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    check(weight.dim() == 1 and weight.shape[0] == x.shape[-1], f"weight must be [{x.shape[-1]}]")
    check(weight.is_contiguous(), "weight must be contiguous")
    hidden = x.shape[-1]
    block = triton.next_power_of_2(hidden)
    check(block <= _MAX_BLOCK, f"hidden size {hidden} exceeds {_MAX_BLOCK}")
    x2 = _rows("x", x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    res2 = res_out = res_out2 = None
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x's shape and dtype")
        check_same_device(x=x, residual=residual, weight=weight)
        res2 = _rows("residual", residual)
        res_out = torch.empty_like(out)
        res_out2 = res_out.view(-1, hidden)
    num_rows = x2.shape[0]
    if num_rows > 0:
        _rms_norm_kernel[(num_rows,)](
            x2, res2 if res2 is not None else x2, weight, out2, res_out2 if res_out2 is not None else out2,
            x2.stride(0), res2.stride(0) if res2 is not None else 0, out2.stride(0),
            res_out2.stride(0) if res_out2 is not None else 0,
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, GEMMA=gemma, num_warps=min(max(block // 256, 1), 16),
            **pdl_launch(x2.device),
        )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., hidden]``; returns a new tensor."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass over the row."""
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim of ``x [..., hidden]``; returns a new tensor."""
    out, _ = _launch(x, None, weight, eps, gemma=True)
    return out


def gemma_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemma_rms_norm(x + residual), x + residual)`` in one pass over the row."""
    out, res_out = _launch(x, residual, weight, eps, gemma=True)
    assert res_out is not None
    return out, res_out
