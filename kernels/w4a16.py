"""Integer weight-only GEMM for pre-quantized AWQ / GPTQ checkpoints (w4a16, and GPTQ's w8a16).

`w4a16_matmul(x, qweight, scales, zeros, g_idx, bits, group_size)`: ``x [M, K]`` (float16, bfloat16 or float32)
times ``W [K, N]``, whose ``bits``-bit values are packed along K in int32 ``qweight [K / p, N]`` (``p = 32 / bits``,
the first value in the lowest bits: GPTQ's layout; asyncllm/models/int4_checkpoint.py repacks AWQ's into it at
load), with per-group ``scales`` and zero points ``zeros`` ``[G, N]`` (float16 or float32; the zero points already
decoded) and the group of input row k ``g_idx[k]`` (GPTQ act-order), or ``k // group_size`` without one:
``W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``.

Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K in ``BLOCK_K`` steps: the packed int32 tile is
loaded (each int32 once per value it holds: the loads hit the same cache lines), the values are shifted out in
registers, dequantized in float32 with their group's scale and zero point, rounded to x's dtype and multiplied
on the tensor cores (float32 accumulation), rounded once to x's dtype at the end: the function of
`reference.w4a16_matmul` up to the order of float32 sums. Without ``g_idx``, when a K step lies inside one group
(``BLOCK_K`` divides ``group_size``), one row of scales and zero points is loaded per step instead of one per K
row. No host sync, no data-dependent launch: it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check, check_float, check_last_dim_contiguous, check_same_device

__all__ = ["w4a16_matmul", "matmul_config"]


@triton.jit(do_not_specialize=["M"])  # the step's rows bound a mask only: one compile per BLOCK_M
def _w4a16_matmul_kernel(
    a_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
    M, N, K, a_stride, qw_stride, s_stride, out_stride,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, TILE_IN_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * a_stride
    lanes = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + lanes
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        packed = tl.load(qw_ptr + (offs_k // PACK).to(tl.int64)[:, None] * qw_stride + offs_n[None, :], mask=w_mask,
                         other=0)
        q = ((packed >> ((offs_k % PACK) * BITS)[:, None]) & MASK).to(tl.float32)
        if TILE_IN_GROUP:  # one group for the whole K step: one row of scales and zero points
            sz = (k0 // GROUP) * s_stride + offs_n
            s = tl.load(s_ptr + sz, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=n_mask, other=0.0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        else:
            if HAS_G_IDX:
                groups = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
            else:
                groups = offs_k // GROUP
            sz = groups.to(tl.int64)[:, None] * s_stride + offs_n[None, :]
            s = tl.load(s_ptr + sz, mask=w_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=w_mask, other=0.0).to(tl.float32)
            w = (q - z) * s
        w = w.to(a_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        if UPCAST:  # the CPU interpreter, and float32 models: an exact float32 product
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m_mask[:, None] & n_mask[None, :])


def matmul_config(num_rows: int, n: int, group_size: int, has_g_idx: bool, on_gpu: bool) -> dict[str, int]:
    """Tile sizes: rows in 16 to 64 (tl.dot's minimum is 16); 64 output columns for decode batches (more programs
    over N when M gives one), 128 past 16 rows; K steps of 64 on a GPU, inside one group when the groups allow."""
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    if on_gpu:
        block_n = 64 if num_rows <= 16 else 128
        block_k = 64
    else:
        block_n = min(64, max(16, triton.next_power_of_2(n)))
        block_k = 32
    if not has_g_idx and group_size % block_k and group_size >= 16 and group_size & (group_size - 1) == 0:
        block_k = min(block_k, group_size)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3 if on_gpu else 1)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           g_idx: torch.Tensor | None, bits: int, group_size: int) -> None:
    check_float("x", x, 2)
    check(bits in (4, 8), f"bits must be 4 or 8, got {bits}")
    check(group_size >= 1, f"group_size must be positive, got {group_size}")
    pack = 32 // bits
    check(qweight.dtype == torch.int32 and qweight.dim() == 2 and qweight.shape[0] * pack == x.shape[1],
          f"qweight must be int32 [K / {pack}, N] = [{x.shape[1] / pack:g}, N], got {qweight.dtype} "
          f"{tuple(qweight.shape)}")
    n = qweight.shape[1]
    check(scales.dtype in (torch.float16, torch.float32) and scales.dim() == 2 and scales.shape[1] == n,
          f"scales must be float16 or float32 [G, {n}], got {scales.dtype} {tuple(scales.shape)}")
    check(zeros.dtype == scales.dtype and zeros.shape == scales.shape and zeros.stride() == scales.stride(),
          f"zeros must be like scales ({scales.dtype} {tuple(scales.shape)}), got {zeros.dtype} {tuple(zeros.shape)}")
    if g_idx is not None:
        check(g_idx.dtype == torch.int32 and tuple(g_idx.shape) == (x.shape[1],) and g_idx.is_contiguous(),
              f"g_idx must be contiguous int32 [{x.shape[1]}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    else:
        check(scales.shape[0] == triton.cdiv(x.shape[1], group_size),
              f"scales must have ceil(K / group_size) = {triton.cdiv(x.shape[1], group_size)} rows, got "
              f"{scales.shape[0]}")
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales)):
        check_last_dim_contiguous(name, t)
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros,
                      **({} if g_idx is None else {"g_idx": g_idx}))


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """``x @ W`` as x's dtype ``[M, N]``; see the module (the shapes are `reference.w4a16_matmul`'s)."""
    _check(x, qweight, scales, zeros, g_idx, bits, group_size)
    (m, k), n = x.shape, qweight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    on_gpu = x.device.type == "cuda"
    config = matmul_config(m, n, group_size, g_idx is not None, on_gpu)
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _w4a16_matmul_kernel[grid](
        x, qweight, scales, zeros, scales if g_idx is None else g_idx, out, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, GROUP=group_size, HAS_G_IDX=g_idx is not None,
        TILE_IN_GROUP=g_idx is None and group_size % config["BLOCK_K"] == 0,
        UPCAST=not on_gpu or x.dtype == torch.float32, **config,
    )
    return out
