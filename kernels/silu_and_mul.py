"""Triton SiLU-and-mul: ``silu(gate) * up`` for ``x = [gate | up]`` along the last dim, and
GeGLU's ``gelu_tanh(gate) * up`` (`gelu_tanh_and_mul`, Gemma's MLP).

Rounds like `asyncllm.kernels.reference.silu_and_mul` under torch: the activation is
computed in float32 and rounded to the dtype, then the product is rounded.
The grid is (rows, column blocks), so a wide MLP row is split across programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check, check_float, check_last_dim_contiguous
from asyncllm.kernels._math import tanh
from asyncllm.kernels._pdl import pdl_enter, pdl_launch

__all__ = ["silu_and_mul", "gelu_tanh_and_mul"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # torch's gelu(approximate="tanh"); 0.79788... = sqrt(2 / pi)
        act = 0.5 * gate * (1.0 + tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2 * d]`` -> ``[..., d]``; returns a new tensor."""
    return _launch(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2 * d]`` -> ``gelu_tanh(gate) * up [..., d]``; returns a new tensor."""
    return _launch(x, gelu_tanh=True)


def _launch(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    check_float("x", x, x.dim())
    check(x.dim() >= 1 and x.shape[-1] % 2 == 0, f"x's last dim must be even, got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    block = min(_BLOCK, triton.next_power_of_2(max(d, 1)))
    if x2.shape[0] > 0 and d > 0:
        grid = (x2.shape[0], triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, GELU_TANH=gelu_tanh,
                                   num_warps=4, **pdl_launch(x2.device))
    return out
