"""Per-token int8 quantization of activations in one Triton kernel (W8A8 int8 experts' inputs, `fused_moe`).

`quantize_int8_per_token(x)`: each row of ``x [M, K]`` with one float32 scale, compressed-tensors' symmetric
``max|x| / 127.5`` (float32's eps where the row is all zeros), the values ``round(clamp(x / scale, -128, 127))``
rounded half to even, as int8. Grid: one program a row, walking K in blocks of at most `MAX_BLOCK` columns twice
(the row's largest magnitude, then its values). Divisions are IEEE (``div_rn``) and the rounding is float32's own
nearest-even addition (``(v + 1.5 * 2**23) - 1.5 * 2**23``, exact for ``|v| <= 128``), so the result equals
`reference.quantize_int8_per_token` (`asyncllm.models.int8`'s, the dense W8A8 layers') bit for bit, in one launch
where the torch function takes about ten ops. Non-finite rows as torch's: a NaN makes the row's scale NaN and its
values 0; an inf makes the scale inf, the inf itself 0 (inf / inf) and the rest 0 (a NaN would otherwise vanish
into a finite scale: `tl.maximum` and `tl.max` skip NaN unless told). Under the interpreter bf16 subnormals load
wrong (Triton 3.9's numpy path), so its tests draw none. No host sync: it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check_float, check_last_dim_contiguous
from asyncllm.kernels.reference import INT8_MAX, INT8_MIN

__all__ = ["MAX_BLOCK", "quant_config", "quantize_int8_per_token"]

MAX_BLOCK = 4096
"""The widest block of columns a program holds at once (wider rows take several, twice over)."""
_HALF_RANGE = (INT8_MAX - INT8_MIN) / 2  # 127.5, compressed-tensors' symmetric divisor
_EPS = torch.finfo(torch.float32).eps  # an all-zero row's scale
_ROUNDER = 1.5 * 2.0**23  # float32 sums near it have a unit of 1: adding it rounds to an integer, ties to even


@triton.jit
def _quantize_int8_kernel(x_ptr, q_ptr, s_ptr, x_stride, q_stride, K, BLOCK: tl.constexpr, HALF_RANGE: tl.constexpr,
                          EPS: tl.constexpr, Q_MIN: tl.constexpr, Q_MAX: tl.constexpr, ROUNDER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    lanes = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + lanes, mask=k0 + lanes < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    scale = tl.math.div_rn(tl.max(amax, axis=0), HALF_RANGE)  # tl.max skips NaN: a NaN row's scale is set below
    scale = tl.where(scale == 0.0, EPS, scale)
    scale = tl.where(tl.sum((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + lanes < K
        x = tl.load(x_row + k0 + lanes, mask=mask, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale)
        v = tl.minimum(tl.maximum(v, Q_MIN, propagate_nan=tl.PropagateNan.ALL), Q_MAX, propagate_nan=tl.PropagateNan.ALL)
        q = tl.where(v != v, 0.0, (v + ROUNDER) - ROUNDER)  # NaN (a NaN row, inf / inf) is 0, as torch's cast
        tl.store(q_ptr + row * q_stride + k0 + lanes, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


def quant_config(k: int) -> dict:
    """The kernel's constexprs and ``num_warps`` for rows of ``k`` columns: the launcher's, and the sm_90 compile
    check's."""
    block = min(MAX_BLOCK, triton.next_power_of_2(max(k, 1)))
    return dict(BLOCK=block, HALF_RANGE=_HALF_RANGE, EPS=_EPS, Q_MIN=INT8_MIN, Q_MAX=INT8_MAX, ROUNDER=_ROUNDER,
                num_warps=4 if block <= 1024 else 8)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float32, float16 or bfloat16, contiguous rows) -> (int8 ``[M, K]``, float32 scales ``[M, 1]``);
    see the module."""
    check_float("x", x, 2)
    check_last_dim_contiguous("x", x)
    num_rows, k = x.shape
    q = torch.empty(num_rows, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows:
        _quantize_int8_kernel[(num_rows,)](x, q, scale, x.stride(0), q.stride(0), k, **quant_config(k))
    return q, scale
