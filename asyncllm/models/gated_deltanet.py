"""Gated DeltaNet linear attention (Qwen3.5's ``linear_attention`` layers) with per-request recurrent state.

A layer keeps, for each request, a state that replaces a KV cache: the last ``K - 1`` inputs of its causal
depthwise convolution (``conv``) and a ``[value heads, key dim, value dim]`` float32 matrix (``ssm``), by worker
row (asyncllm/models/row_states.py). Each token then:

- projects to q, k (``linear_num_key_heads``) and v (``linear_num_value_heads``), run through the convolution
  (SiLU), a gate ``z``, a write strength ``beta = sigmoid(b)`` and a log decay ``g = -exp(A_log) *
  softplus(a + dt_bias)``;
- updates the state by the gated delta rule, per value head (q and k L2-normed, q scaled by ``key dim ** -0.5``,
  each key head serving ``Hv / Hk`` consecutive value heads): ``S <- exp(g) S``; ``S <- S + k (beta (v - S^T k))^T``;
  output ``S^T q``;
- norms each head's output (RMSNorm, weight as stored) times ``silu(z)``, then ``out_proj``.

A prefill chunk runs the rule in blocks of 64 tokens (`chunked_delta_rule`: the standard WY form, one triangular
solve a block), a decode step for every request at once on their state rows in place (`ModelOps.gated_delta_step`:
torch, or kernels/gated_delta.py with the triton backend); both equal the token-by-token
recurrence (tests/unit/test_gated_deltanet.py) and transformers' float32 results. The prefix cache restores them
from saved states, speculative decoding from per-draft snapshots; swap preemption and CUDA graphs do not apply to
them (docs/hybrid-models.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import TensorParallel, new_param
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.ops import REFERENCE_OPS, ModelOps
from asyncllm.models.row_states import DepthwiseConv, RowStates, StateRows, causal_conv, conv_step

__all__ = ["GatedDeltaNet", "blockwise", "chunked_delta_rule", "prepare_qk", "run_rows"]

_BLOCK = 64
"""Tokens per block of `chunked_delta_rule`."""


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, Hk, Dk]`` queries and keys -> float32 ``[T, Hv, Dk]``: L2-normed, q scaled by ``Dk ** -0.5``, each
    key head repeated for its ``Hv / Hk`` value heads."""
    repeat = num_v_heads // q.shape[1]
    q, k = (_l2norm(t.float()).repeat_interleave(repeat, dim=1) for t in (q, k))
    return q * q.shape[-1] ** -0.5, k


def chunked_delta_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> torch.Tensor:
    """One request's ``T`` tokens: ``state [Hv, Dk, Dv]`` (updated in place), ``q, k [T, Hv, Dk]``, ``v [T, Hv, Dv]``,
    ``g, beta [T, Hv]``, all float32 -> output ``[T, Hv, Dv]``.

    Within a block of C tokens with cumulative log decay ``c_i``: the values each token writes,
    ``u = (I + A)^-1 (beta v - beta e^c k S0)`` with ``A_ij = beta_i e^(c_i - c_j) k_i . k_j`` below the diagonal;
    the outputs ``e^c q S0 + ((q k^T) * e^(c_i - c_j), j <= i) u``; the state ``e^(c_C) S0 + (e^(c_C - c) k)^T u``."""
    return blockwise(_block, state, q, k, v, g, beta)


def run_rows(layer: Any, step: Any, out: torch.Tensor, *tokens: torch.Tensor) -> None:
    """A linear-attention layer's step into ``out`` (``tokens``: its per-token inputs, as ``mixed, g, beta``):
    every request's one token at once (``layer._decode(*tokens, rows)``) when the step only decodes (the rows'
    states saved for prefix caching), else its decodes and drafts by row group and each prefill chunk on its own
    (``layer._prefill(*tokens, row, out)``)."""
    if step.decode_only:
        n = len(step.rows)
        out[:n] = layer._decode(*(t[:n] for t in tokens), step.rows)
        layer.states.save_decoded(step)
        return
    for rows, index in layer.states.positions(step):  # decodes and drafted requests
        out[index] = layer._decode(*(t[index] for t in tokens), rows)
    for row, span in layer.states.spans(step):
        layer._prefill(*(t[span] for t in tokens), row, out[span])


def blockwise(block_fn: Any, state: torch.Tensor, *tokens: torch.Tensor) -> torch.Tensor:
    """A delta rule's output over ``T`` tokens, `_BLOCK` at a time: ``block_fn(state, q, k, v, g, beta)`` on each
    block with heads first (``tokens``: ``q, k, v, g, beta``, tokens first; the output as ``v``)."""
    out = torch.empty_like(tokens[2])
    for start in range(0, tokens[0].shape[0], _BLOCK):
        block = slice(start, start + _BLOCK)
        out[block] = block_fn(state, *(t[block].transpose(0, 1) for t in tokens)).transpose(0, 1)
    return out


def _block(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor) -> torch.Tensor:
    """`chunked_delta_rule` on one block, heads first: ``q, k [H, C, Dk]``, ``v [H, C, Dv]``, ``g, beta [H, C]``."""
    size = q.shape[1]
    c = g.cumsum(dim=-1)
    below = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~below, float("-inf")).exp()  # e^(c_i - c_j), j <= i
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(size, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False)
    u = u - torch.linalg.solve_triangular(system, k_beta * c.exp().unsqueeze(-1), upper=False) @ state
    out = (q * c.exp().unsqueeze(-1)) @ state + (q @ k.transpose(-1, -2) * decay) @ u
    last = c[:, -1:]
    state.mul_(last.exp().unsqueeze(-1)).add_((k * (last - c).exp().unsqueeze(-1)).transpose(-1, -2) @ u)
    return out


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x)`` (rounded to x's dtype first) times ``silu(gate)`` in float32, as transformers."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * normed.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A ``linear_attention`` layer; every tensor-parallel rank computes it whole (its projections are not split)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, rows: StateRows, ops: ModelOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key, value = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.split = [key, key, value]
        whole, hidden = TensorParallel(), cfg.hidden_size
        self.in_proj_qkv = ColumnParallelLinear(hidden, 2 * key + value, False, whole, dtype)
        self.in_proj_z = ColumnParallelLinear(hidden, value, False, whole, dtype)
        self.in_proj_b = ColumnParallelLinear(hidden, self.num_v_heads, False, whole, dtype)
        self.in_proj_a = ColumnParallelLinear(hidden, self.num_v_heads, False, whole, dtype)
        self.conv1d = DepthwiseConv(2 * key + value, cfg.linear_conv_kernel_dim, False, dtype)
        self.dt_bias = new_param(self.num_v_heads, dtype=dtype)
        self.A_log = new_param(self.num_v_heads, dtype=dtype)
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = ColumnParallelLinear(value, hidden, False, whole, dtype)
        self.gated_delta_step = ops.gated_delta_step
        """The decode step over the requests' state rows (torch, or the Triton kernel with the triton backend)."""
        self.states = RowStates(rows, {
            "conv": ((2 * key + value, cfg.linear_conv_kernel_dim - 1), dtype),
            "ssm": ((self.num_v_heads, self.k_dim, self.v_dim), torch.float32),
        })

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: Any,
                metadata: AttentionMetadata) -> torch.Tensor:
        step = self.states.begin(metadata, hidden.device)
        tokens = hidden.shape[0]
        mixed = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden).view(tokens, self.num_v_heads, self.v_dim)
        beta = self.in_proj_b(hidden).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        out = torch.zeros(tokens, self.num_v_heads, self.v_dim, dtype=hidden.dtype, device=hidden.device)
        run_rows(self, step, out, mixed, g, beta)
        normed = self.norm(out.view(-1, self.v_dim), z.view(-1, self.v_dim)).view(tokens, -1)
        return self.out_proj(normed)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = mixed.split(self.split, dim=-1)
        n = mixed.shape[0]
        q, k = prepare_qk(q.reshape(n, self.num_k_heads, self.k_dim), k.reshape(n, self.num_k_heads, self.k_dim),
                          self.num_v_heads)
        return q, k, v.reshape(n, self.num_v_heads, self.v_dim).float()

    def _prefill(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, row: int, out: torch.Tensor) -> None:
        convolved = causal_conv(mixed, self.states["conv"][row], self.conv1d)
        q, k, v = self._heads(convolved)
        out.copy_(chunked_delta_rule(self.states["ssm"][row], q, k, v, g, beta))

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One token of each of the rows' requests, all at once: the rows' states gathered, stepped, scattered
        back."""
        q, k, v = self._heads(conv_step(mixed, self.states["conv"], rows, self.conv1d))
        return self.gated_delta_step(self.states["ssm"], rows, q, k, v, g, beta).to(mixed.dtype)
