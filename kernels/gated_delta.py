"""Triton decode step of the gated delta rule (Qwen3.5 / Qwen3-Next's linear attention): one token of each of N
requests, each request's float32 state ``[Hv, Dk, Dv]`` read and written in place at its worker row.

``gated_delta_step(states, rows, q, k, v, g, beta)`` computes `reference.gated_delta_step`: ``S <- e^g S``, the
delta-rule write ``S <- S + k (beta (v - S^T k))^T``, the output ``S^T q``. Grid (requests, value heads, blocks of
``Dv``): a program holds its ``[Dk, BLOCK_V]`` slice of the state (the rule is column-wise in ``Dv``), so the
state is read once and written once, with no gather or scatter of rows (the torch reference makes five passes).
No host sync: it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.kernels._checks import check, check_same_device

__all__ = ["gated_delta_step"]


@triton.jit
def _gated_delta_step_kernel(
    states_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    s_row, s_head, s_k, qk_n, qk_h, v_n, v_h, g_n, o_n, o_h, DK, DV,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    row = tl.load(rows_ptr + n).to(tl.int64)
    s_ptrs = states_ptr + row * s_row + h * s_head + offs_k[:, None] * s_k + offs_v[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(s_ptrs, mask=mask, other=0.0)
    key = tl.load(k_ptr + n * qk_n + h * qk_h + offs_k, mask=k_mask, other=0.0)
    query = tl.load(q_ptr + n * qk_n + h * qk_h + offs_k, mask=k_mask, other=0.0)
    value = tl.load(v_ptr + n * v_n + h * v_h + offs_v, mask=v_mask, other=0.0)
    g = tl.load(g_ptr + n * g_n + h)
    beta = tl.load(beta_ptr + n * g_n + h)
    state = state * tl.exp(g)
    predicted = tl.sum(state * key[:, None], axis=0)
    state = state + key[:, None] * ((value - predicted) * beta)[None, :]
    tl.store(s_ptrs, state, mask=mask)
    tl.store(out_ptr + n * o_n + h * o_h + offs_v, tl.sum(state * query[:, None], axis=0), mask=v_mask)


def gated_delta_step(states: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The shapes of `reference.gated_delta_step`; every tensor float32 but ``rows`` (int32/int64, distinct)."""
    check(states.dim() == 4 and states.dtype == torch.float32 and states.stride(-1) == 1,
          f"states must be float32 [R, Hv, Dk, Dv] with contiguous rows, got {states.dtype} {tuple(states.shape)}")
    _, heads, dk, dv = states.shape
    n = rows.shape[0]
    check(rows.dim() == 1 and rows.dtype in (torch.int32, torch.int64), f"rows must be int [N], got {rows.dtype}")
    if rows.stride(0) != 1 and n > 1:  # read at ptr + i
        raise ValueError(f"rows must be contiguous (stride 1): {rows.stride()}")
    for name, t, shape in (("q", q, (n, heads, dk)), ("k", k, (n, heads, dk)), ("v", v, (n, heads, dv)),
                           ("g", g, (n, heads)), ("beta", beta, (n, heads))):
        check(t.dtype == torch.float32 and tuple(t.shape) == shape and t.stride(-1) == 1,
              f"{name} must be float32 {list(shape)} with contiguous rows, got {t.dtype} {tuple(t.shape)}")
    check(q.stride() == k.stride() and g.stride() == beta.stride(), "q and k (g and beta) must share strides")
    check_same_device(states=states, rows=rows, q=q, k=k, v=v, g=g, beta=beta)
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=states.device)
    if n == 0:
        return out
    block_v = min(triton.next_power_of_2(dv), 32 if states.is_cuda else 16)
    _gated_delta_step_kernel[(n, heads, triton.cdiv(dv, block_v))](
        states, rows, q, k, v, g, beta, out,
        states.stride(0), states.stride(1), states.stride(2), q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        g.stride(0), out.stride(0), out.stride(1), dk, dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=4,
    )
    return out
