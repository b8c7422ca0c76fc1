"""Block-scaled fp8 products for pre-quantized fp8 checkpoints (w8a8, DeepSeek/Qwen "fp8" block format).

- `per_token_group_quant_fp8(x, group_size)`: each row of ``x [M, K]`` in groups of ``group_size``
  features, one float32 scale per group, ``max|group| / 448`` (at least `reference.FP8_MIN_SCALE`), the
  values rounded to float8_e4m3fn (nearest even, saturated; `_fp8.to_storage`). Grid: (rows, groups).
  Divisions are IEEE (``div_rn``), so the result equals `reference.per_token_group_quant_fp8` bit for bit.
- `static_quant_fp8(x, scale)`: the same kernel with a static per-tensor scale read from ``scale`` (static fp8
  activation scales: per-tensor fp8 experts' ``w13_input_scale`` / ``w2_input_scale``) instead of each group's
  absmax, ``fp8(clamp(x / scale, -448, 448))`` with the same IEEE division and rounding: bit for bit
  `reference.static_quant_fp8`, without its float32 copy of ``x``.
- `w8a8_block_fp8_matmul(a_q, a_s, b_q, b_s, (bn, bk), out_dtype)`: ``a [M, K]`` fp8 with per-token-group
  scales ``a_s [M, ceil(K/bk)]`` times ``b [N, K]^T`` fp8 with block scales ``b_s [ceil(N/bn), ceil(K/bk)]``.
  Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K one scale group at a time: the fp8
  tile product (float32 accumulation) is scaled by the group's ``a_s`` (per row) and ``b_s`` (per column,
  the block of each column) and added to a float32 accumulator, rounded once to ``out_dtype`` at the end.

The product runs on fp8 tensor cores: a CUDA device of compute capability >= 8.9 (Triton has no float8_e4m3fn
before Ada; older GPUs take the dequantize fallback, asyncllm/models/fp8_checkpoint.py). Triton's CPU
interpreter upcasts the fp8 tiles to float32 first, exactly. No host sync, no data-dependent launch: both run
inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check, check_float, check_last_dim_contiguous, check_same_device
from asyncllm.kernels._fp8 import to_storage
from asyncllm.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE

__all__ = ["per_token_group_quant_fp8", "static_quant_fp8", "w8a8_block_fp8_matmul", "matmul_config"]

_FP8 = torch.float8_e4m3fn
STATIC_BLOCK = 1024
"""`static_quant_fp8`'s columns per program (its scale is given: a row need not be one program's)."""


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, x_stride, q_stride, s_stride, K,
                        GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                        STATIC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    offs = group * GROUP + lanes
    mask = (lanes < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if STATIC:  # `static_quant_fp8`: the one scale read, each row's ``s [M, 1]`` written by its first program
        scale = tl.load(static_ptr)
    else:
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
    q = to_storage(tl.math.div_rn(x, scale), q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * q_stride + offs, q, mask=mask)
    if STATIC:
        if group == 0:
            tl.store(s_ptr + row * s_stride, scale)
    else:
        tl.store(s_ptr + row * s_stride + group, scale)


@triton.jit(do_not_specialize=["M"])  # the step's rows bound a mask only: one compile per BLOCK_M
def _block_fp8_matmul_kernel(
    a_ptr, a_s_ptr, b_ptr, b_s_ptr, out_ptr,
    M, N, K, a_stride, a_s_stride, b_stride, b_s_stride, out_stride,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * a_stride
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * b_stride  # b is [N, K]: a [BLOCK_K, BLOCK_N] tile of b^T
    a_s_rows = a_s_ptr + offs_m.to(tl.int64) * a_s_stride
    b_s_rows = b_s_ptr + (offs_n // GROUP_N).to(tl.int64) * b_s_stride
    lanes = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for group in range(tl.cdiv(K, GROUP_K)):
        offs_k = group * GROUP_K + lanes
        k_mask = (lanes < GROUP_K) & (offs_k < K)
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        a_s = tl.load(a_s_rows + group, mask=m_mask, other=0.0)
        b_s = tl.load(b_s_rows + group, mask=n_mask, other=0.0)
        acc += part * a_s[:, None] * b_s[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 ``[M, ceil(K / group_size)]``); see the module. A group
    of at least K features: one scale per row."""
    check_float("x", x, 2)
    check_last_dim_contiguous("x", x)
    check(group_size >= 1, f"group_size must be positive, got {group_size}")
    num_rows, k = x.shape
    group_size = max(1, min(group_size, k))
    groups = triton.cdiv(k, group_size)
    q = torch.empty(num_rows, k, dtype=_FP8, device=x.device)
    scale = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)
    if num_rows and k:
        _group_quant_kernel[(num_rows, groups)](
            x, q, scale, scale, x.stride(0), q.stride(0), scale.stride(0), k,
            GROUP=group_size, BLOCK=triton.next_power_of_2(group_size), FP8_MAX=FP8_E4M3_MAX,
            MIN_SCALE=FP8_MIN_SCALE, STATIC=False,
        )
    return q, scale


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` with a static per-tensor ``scale`` (one float32 value) -> (float8_e4m3fn ``[M, K]``,
    float32 ``[M, 1]`` all ``scale``): `reference.static_quant_fp8` bit for bit, no float32 copy of ``x``; see the
    module. Grid: (rows, ``STATIC_BLOCK`` column tiles)."""
    check_float("x", x, 2)
    check_last_dim_contiguous("x", x)
    check(scale.dtype == torch.float32 and scale.numel() == 1,
          f"scale must be one float32 value, got {scale.dtype} {tuple(scale.shape)}")
    check_same_device(x=x, scale=scale)
    num_rows, k = x.shape
    q = torch.empty(num_rows, k, dtype=_FP8, device=x.device)
    scales = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows and k:
        block = min(STATIC_BLOCK, triton.next_power_of_2(k))
        _group_quant_kernel[(num_rows, triton.cdiv(k, block))](
            x, q, scales, scale, x.stride(0), q.stride(0), scales.stride(0), k,
            GROUP=block, BLOCK=block, FP8_MAX=FP8_E4M3_MAX, MIN_SCALE=FP8_MIN_SCALE, STATIC=True,
        )
    return q, scales


def matmul_config(num_rows: int, n: int, on_gpu: bool) -> dict[str, int]:
    """Tile sizes and launch options: 128 output columns (a 128-row weight block) per program on a GPU, rows
    in 16 to 64 (tl.dot's minimum is 16)."""
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    block_n = 128 if on_gpu else min(64, max(16, triton.next_power_of_2(n)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=3 if on_gpu else 1)


def _check_matmul(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                  block_size: tuple[int, int]) -> None:
    block_n, block_k = block_size
    check(block_n >= 1 and block_k >= 1, f"block_size must be positive, got {block_size}")
    for name, t in (("a_q", a_q), ("b_q", b_q)):
        check(t.dtype == _FP8 and t.dim() == 2, f"{name} must be a 2-D float8_e4m3fn tensor, got {t.dtype} "
                                                f"{tuple(t.shape)}")
    (m, k), n = a_q.shape, b_q.shape[0]
    check(b_q.shape[1] == k, f"a_q is [M, {k}] but b_q is {tuple(b_q.shape)}")
    groups = triton.cdiv(k, block_k)
    for name, t, shape in (("a_s", a_s, (m, groups)), ("b_s", b_s, (triton.cdiv(n, block_n), groups))):
        check(t.dtype == torch.float32 and tuple(t.shape) == shape,
              f"{name} must be float32 of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("a_q", a_q), ("a_s", a_s), ("b_q", b_q), ("b_s", b_s)):
        check_last_dim_contiguous(name, t)
    check_same_device(a_q=a_q, a_s=a_s, b_q=b_q, b_s=b_s)


def w8a8_block_fp8_matmul(
    a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, block_size: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dq(a) @ dq(b).T`` as ``out_dtype [M, N]``; the shapes are `reference.w8a8_block_fp8_matmul`'s."""
    _check_matmul(a_q, a_s, b_q, b_s, block_size)
    (m, k), n = a_q.shape, b_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k = block_size
    config = matmul_config(m, n, a_q.device.type == "cuda")
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _block_fp8_matmul_kernel[grid](
        a_q, a_s, b_q, b_s, out, m, n, k,
        a_q.stride(0), a_s.stride(0), b_q.stride(0), b_s.stride(0), out.stride(0),
        GROUP_N=block_n, GROUP_K=block_k, BLOCK_K=max(16, triton.next_power_of_2(block_k)),
        UPCAST=a_q.device.type != "cuda", **config,
    )
    return out
