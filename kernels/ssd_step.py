"""Triton decode step of Mamba2's scan (Granite 4.0, Nemotron-H, Falcon-H1, Bamba): one token of each of N requests,
each request's float32 state ``[H, P, S]`` read and written in place at its worker row.

``ssd_decode_step(states, rows, x, b, c, dt, a)`` computes `reference.ssd_decode_step`: ``S <- e^(dt a) S + dt x
b^T`` and the output ``S c`` (``D x`` is the caller's). Grid (requests, heads, blocks of ``P``): a program holds its
``[BLOCK_P, S]`` slice of the state, so the state is read once and written once, with no gather or scatter of
rows. No host sync: it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check, check_same_device

__all__ = ["ssd_decode_step"]


@triton.jit
def _ssd_step_kernel(
    states_ptr, rows_ptr, x_ptr, b_ptr, c_ptr, dt_ptr, a_ptr, out_ptr,
    s_row, s_head, s_p, x_n, x_h, bc_n, bc_h, dt_n, o_n, o_h, P, S,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    p_mask = offs_p < P
    s_mask = offs_s < S
    row = tl.load(rows_ptr + n).to(tl.int64)
    s_ptrs = states_ptr + row * s_row + h * s_head + offs_p[:, None] * s_p + offs_s[None, :]
    mask = p_mask[:, None] & s_mask[None, :]
    state = tl.load(s_ptrs, mask=mask, other=0.0)
    x = tl.load(x_ptr + n * x_n + h * x_h + offs_p, mask=p_mask, other=0.0)
    b = tl.load(b_ptr + n * bc_n + h * bc_h + offs_s, mask=s_mask, other=0.0)
    c = tl.load(c_ptr + n * bc_n + h * bc_h + offs_s, mask=s_mask, other=0.0)
    dt = tl.load(dt_ptr + n * dt_n + h)
    state = state * tl.exp(dt * tl.load(a_ptr + h)) + (dt * x)[:, None] * b[None, :]
    tl.store(s_ptrs, state, mask=mask)
    tl.store(out_ptr + n * o_n + h * o_h + offs_p, tl.sum(state * c[None, :], axis=1), mask=p_mask)


def ssd_decode_step(states: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    dt: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The shapes of `reference.ssd_decode_step`; every tensor float32 but ``rows`` (int32/int64, distinct)."""
    check(states.dim() == 4 and states.dtype == torch.float32 and states.stride(-1) == 1,
          f"states must be float32 [R, H, P, S] with contiguous rows, got {states.dtype} {tuple(states.shape)}")
    _, heads, p, s = states.shape
    n = rows.shape[0]
    check(rows.dim() == 1 and rows.dtype in (torch.int32, torch.int64), f"rows must be int [N], got {rows.dtype}")
    if rows.stride(0) != 1 and n > 1:  # read at ptr + i
        raise ValueError(f"rows must be contiguous (stride 1): {rows.stride()}")
    for name, t, shape in (("x", x, (n, heads, p)), ("b", b, (n, heads, s)), ("c", c, (n, heads, s)),
                           ("dt", dt, (n, heads)), ("a", a, (heads,))):
        check(t.dtype == torch.float32 and tuple(t.shape) == shape and t.stride(-1) == 1,
              f"{name} must be float32 {list(shape)} with contiguous rows, got {t.dtype} {tuple(t.shape)}")
    check(b.stride() == c.stride(), "b and c must share strides")
    check_same_device(states=states, rows=rows, x=x, b=b, c=c, dt=dt, a=a)
    out = torch.empty(n, heads, p, dtype=torch.float32, device=states.device)
    if n == 0:
        return out
    block_p = min(triton.next_power_of_2(p), 16)
    _ssd_step_kernel[(n, heads, triton.cdiv(p, block_p))](
        states, rows, x, b, c, dt, a, out,
        states.stride(0), states.stride(1), states.stride(2), x.stride(0), x.stride(1), b.stride(0), b.stride(1),
        dt.stride(0), out.stride(0), out.stride(1), p, s,
        BLOCK_P=block_p, BLOCK_S=triton.next_power_of_2(s), num_warps=4,
    )
    return out
