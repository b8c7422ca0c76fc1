"""Triton matrix-vector products for decode steps, with the op before them fused in.

At batch 1 a small model's decode step spends about as long in small
launches (norms, SiLU-and-mul) as in its matrix products. `decode_linear`
computes ``f(x) @ weight.T (+ bias)`` for an ``x`` of at most `MAX_ROWS` rows,
where ``f`` is the op before the product, done as each program loads its
slice of x:

- ``prologue=None``: x as it is;
- ``"add_rms_norm"``: the residual add and RMSNorm (`kernels/rms_norm.py`); the
  new residual is written too, by the programs of the first column block;
- ``"silu_and_mul"``: x is ``[gate | up]`` (`kernels/silu_and_mul.py`).

``f`` rounds exactly like the separate kernel, so the product reads the same
input the unfused path would; only the float32 accumulation order differs
from cuBLAS's. Grid: (column blocks, rows); a program reads its
``[BLOCK_N, K]`` weight slice in ``BLOCK_K`` steps, each step's weights loaded
one step ahead (the first before the row's norm statistics), so the weight
reads overlap the prologue; rows of one column block share the slice through
the L2 cache. The Llama-family layers run their four products through it
(`LlamaDecoderLayer.forward_fused_decode`) for steps of at most `FUSED_ROWS`
rows: at batch 1 on an H200 it took 20 us per Qwen3-0.6B layer where the
separate kernels and cuBLAS took 34 (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check, check_float, check_same_device
from asyncllm.kernels._pdl import pdl_enter, pdl_launch

__all__ = ["FUSED_ROWS", "MAX_ROWS", "PROLOGUES", "block_sizes", "decode_linear"]

MAX_ROWS = 16
"""Rows of x one call takes: a decode batch small enough that the weights, not the rows, cost."""
FUSED_ROWS = 2
"""Rows up to which the fused products beat the separate op plus cuBLAS (each row re-reads the weights through
the L2 cache; cuBLAS reads them once): the most rows of a step the models' fused decode path runs."""
PROLOGUES = {None: 0, "add_rms_norm": 1, "silu_and_mul": 2}


@triton.jit
def _summed(x_row, res_row, offs_k, k_mask, dtype):
    """``x + residual`` rounded to the dtype (as `fused_add_rms_norm` stores it), in float32."""
    x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    residual = tl.load(res_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return (x + residual).to(dtype).to(tl.float32)


@triton.jit
def _decode_linear_kernel(
    x_ptr, residual_ptr, norm_w_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr,
    x_stride, residual_stride, weight_stride, out_stride, residual_out_stride,
    N, K, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    x_row = x_ptr + row * x_stride
    res_row = residual_ptr + row * residual_stride
    w_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * weight_stride
    first_k = tl.arange(0, BLOCK_K)  # the first weight tile is on its way while the row's statistics are summed
    w = tl.load(w_rows + first_k[None, :], mask=n_mask[:, None] & (first_k < K)[None, :], other=0.0)
    pdl_enter(PDL)  # the weights are no kernel's output: their first tile overlaps the previous kernel's end
    if PROLOGUE == 1:  # the row's statistics first: K values, next to the BLOCK_N * K of the weight slice
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            summed = _summed(x_row, res_row, offs_k, offs_k < K, dtype)
            squares += summed * summed
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        next_k = offs_k + BLOCK_K  # the next step's weights, loaded before this step's x (one step ahead)
        w_next = tl.load(w_rows + next_k[None, :], mask=n_mask[:, None] & (next_k < K)[None, :], other=0.0)
        if PROLOGUE == 0:
            a = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        elif PROLOGUE == 1:  # as kernels/rms_norm.py rounds: the sum, the normed row, the weighted row
            summed = _summed(x_row, res_row, offs_k, k_mask, dtype)
            if pid_n == 0:
                tl.store(residual_out_ptr + row * residual_out_stride + offs_k, summed.to(dtype), mask=k_mask)
            normed = (summed * rstd).to(dtype).to(tl.float32)
            norm_w = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            a = (norm_w * normed).to(dtype).to(tl.float32)
        else:  # as kernels/silu_and_mul.py rounds: silu(gate), then the product with up
            gate = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(x_row + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            a = (silu * up).to(dtype).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        w = w_next
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs_n, acc.to(dtype), mask=n_mask)


def block_sizes(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): about 512 column blocks of 2 to 8 columns, K steps of up to 1024: one rule within 0.7 us
    of the best of 90 configurations at each Qwen3-0.6B decode product on an H200 (docs/kernels.md; the best per
    product would save ~0.03 ms a step); `decode_linear` launches them with 4 warps whatever the sizes."""
    block_n = min(8, max(2, triton.next_power_of_2(-(-n // 512))))
    return block_n, min(1024, triton.next_power_of_2(k))


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prologue: str | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``f(x) @ weight.T (+ bias)`` for ``x [M, K]`` (``[M, 2K]`` for silu_and_mul), ``M <= MAX_ROWS``.

    ``add_rms_norm`` takes ``residual [M, K]`` and ``norm_weight [K]`` and returns ``(out, x + residual)``;
    the others return ``out [M, N]``.
    """
    check(prologue in PROLOGUES, f"prologue must be one of {list(PROLOGUES)}, got {prologue!r}")
    check_float("x", x, 2)
    check(x.stride(-1) == 1 and weight.stride(-1) == 1, "x and weight must be contiguous in their last dim")
    num_rows, n = x.shape[0], weight.shape[0]
    k = x.shape[1] // 2 if prologue == "silu_and_mul" else x.shape[1]
    check(num_rows <= MAX_ROWS, f"x has {num_rows} rows, at most {MAX_ROWS} (a decode batch)")
    check(weight.dim() == 2 and weight.shape[1] == k and weight.dtype == x.dtype,
          f"weight must be [N, {k}] of {x.dtype}, got {tuple(weight.shape)} of {weight.dtype}")
    check(bias is None or (bias.shape == (n,) and bias.dtype == x.dtype), f"bias must be [{n}] of {x.dtype}")
    check_same_device(x=x, weight=weight)
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    res, res_out, norm_w = x, out, x
    if prologue == "add_rms_norm":
        check(residual is not None and residual.shape == x.shape and residual.dtype == x.dtype
              and residual.stride(-1) == 1, "add_rms_norm needs a residual of x's shape and dtype")
        check(norm_weight is not None and norm_weight.shape == (k,) and norm_weight.is_contiguous(),
              f"add_rms_norm needs a contiguous norm_weight [{k}]")
        assert residual is not None and norm_weight is not None
        res, norm_w, res_out = residual, norm_weight, torch.empty_like(x)
    if num_rows and n:
        block_n, block_k = block_sizes(n, k)
        _decode_linear_kernel[(triton.cdiv(n, block_n), num_rows)](
            x, res, norm_w, weight, bias if bias is not None else weight, out, res_out,
            x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
            n, k, eps,
            PROLOGUE=PROLOGUES[prologue], HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
            **pdl_launch(x.device),
        )
    return (out, res_out) if prologue == "add_rms_norm" else out
