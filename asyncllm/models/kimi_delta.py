"""Kimi Delta Attention (KDA: Kimi-Linear's ``linear_attention`` layers) with per-request recurrent state.

KDA is Gated DeltaNet's rule (asyncllm/models/gated_deltanet.py) with a decay per key channel instead of one scalar
per head. A layer keeps, per request and by worker row (asyncllm/models/row_states.py), the last ``K - 1`` inputs
of its short convolutions (``conv``: q, k and v side by side) and a ``[heads, key dim, value dim]`` float32 state
(``ssm``). Each token:

- projects to q, k, v (``q_proj`` / ``k_proj`` / ``v_proj``, ``linear_num_heads`` heads of ``linear_head_dim``
  each), run through their causal depthwise convolutions (SiLU); q and k L2-normed in float32 (``x / sqrt(|x|^2 +
  1e-6)``, FLA's), q scaled by ``head_dim ** -0.5``;
- a log decay per key channel ``g = -exp(A_log[head]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` (softplus as
  transformers writes it: ``x`` past 20, else ``log(1 + exp(x))``) and a write strength ``beta = sigmoid(b_proj(x))``;
- updates the state ``S <- diag(exp(g)) S``; ``S <- S + k (beta (v - S^T k))^T``; outputs ``S^T q``;
- norms each head's output (RMSNorm in float32) times ``sigmoid(g_b_proj(g_a_proj(x)))``, then ``o_proj``.

A prefill chunk runs the rule in blocks of 64 tokens (`chunked_kda`: the WY form of `chunked_delta_rule` with the
decays as ``[C, C, key dim]`` tensors), a decode step for every request at once on their state rows (`kda_step`,
torch with every backend). Both equal the token-by-token recurrence and transformers' float32 results
(tests/unit/test_kimi_linear.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.gated_deltanet import GatedRMSNorm, blockwise, run_rows
from asyncllm.models.layers import TensorParallel, new_param
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.row_states import DepthwiseConv, RowStates, StateRows, causal_conv, conv_step

__all__ = ["KimiDeltaAttention", "chunked_kda", "kda_step"]



def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H, Dk]`` queries and keys -> float32, L2-normed, q scaled by ``Dk ** -0.5``."""
    q, k = _l2norm(q.float()), _l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def kda_step(states: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token of each of N requests: ``states [R, H, Dk, Dv]`` float32 (request n's at row ``rows[n]``,
    updated), ``q, k, g [N, H, Dk]``, ``v [N, H, Dv]``, ``beta [N, H]`` float32 -> ``[N, H, Dv]``."""
    state = states[rows] * g.exp().unsqueeze(-1)
    predicted = (state * k.unsqueeze(-1)).sum(dim=-2)
    state = state + k.unsqueeze(-1) * ((v - predicted) * beta.unsqueeze(-1)).unsqueeze(-2)
    states[rows] = state
    return (state * q.unsqueeze(-1)).sum(dim=-2)


def chunked_kda(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """One request's ``T`` tokens: ``state [H, Dk, Dv]`` (updated in place), ``q, k, g [T, H, Dk]``, ``v [T, H,
    Dv]``, ``beta [T, H]``, all float32 -> output ``[T, H, Dv]``.

    Within a block of C tokens with cumulative log decays ``c_i`` (per key channel): the values each token writes,
    ``u = (I + A)^-1 (beta v - beta (e^c * k) S0)`` with ``A_ij = beta_i sum_d k_id k_jd e^(c_id - c_jd)`` below
    the diagonal; the outputs ``(e^c * q) S0 + (sum_d q_id k_jd e^(c_id - c_jd), j <= i) u``; the state
    ``e^(c_C) * S0 + (e^(c_C - c) * k)^T u``."""
    return blockwise(_block, state, q, k, v, g, beta)


def _block(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor) -> torch.Tensor:
    """`chunked_kda` on one block, heads first: ``q, k, g [H, C, Dk]``, ``v [H, C, Dv]``, ``beta [H, C]``."""
    size = q.shape[1]
    c = g.cumsum(dim=1)
    below = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(2) - c.unsqueeze(1)).masked_fill(~below.unsqueeze(-1), float("-inf")).exp()  # [H, i, j, Dk]
    k_beta = k * beta.unsqueeze(-1)
    pairs = (k_beta.unsqueeze(2) * k.unsqueeze(1) * decay).sum(-1)
    system = pairs.tril(-1) + torch.eye(size, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False)
    u = u - torch.linalg.solve_triangular(system, k_beta * c.exp(), upper=False) @ state
    out = (q * c.exp()) @ state + (q.unsqueeze(2) * k.unsqueeze(1) * decay).sum(-1) @ u
    last = c[:, -1:]
    state.mul_(last.exp().transpose(-1, -2)).add_((k * (last - c).exp()).transpose(-1, -2) @ u)
    return out


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """transformers' (and FLA's) softplus: ``x`` past 20, else ``log(1 + exp(x))`` (not log1p: the same bits)."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


class SigmoidGatedNorm(GatedRMSNorm):
    """``weight * rmsnorm(x) * sigmoid(gate)``, all in float32, rounded to x's dtype at the end (transformers'
    ``KimiLinearRMSNormGated``; Gated DeltaNet's norm gates by SiLU and rounds the normed value first)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed * gate.float().sigmoid()).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """A ``linear_attention`` layer; every tensor-parallel rank computes it whole (its projections are not split)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, rows: StateRows) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.linear_num_heads, cfg.linear_head_dim
        width, hidden, whole = self.num_heads * self.head_dim, cfg.hidden_size, TensorParallel()
        self.width = width

        def linear(n_in: int, n_out: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(n_in, n_out, False, whole, dtype)

        self.q_proj, self.k_proj, self.v_proj = linear(hidden, width), linear(hidden, width), linear(hidden, width)
        self.conv1d = DepthwiseConv(3 * width, cfg.linear_conv_kernel_dim, False, dtype)
        """q's, k's and v's convolutions stacked (the checkpoint's ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``)."""
        self.f_a_proj, self.f_b_proj = linear(hidden, self.head_dim), linear(self.head_dim, width)
        self.dt_bias = new_param(width, dtype=torch.float32)  # transformers keeps it in float32
        self.A_log = new_param(1, 1, self.num_heads, 1, dtype=dtype)
        self.b_proj = linear(hidden, self.num_heads)
        self.g_a_proj, self.g_b_proj = linear(hidden, self.head_dim), linear(self.head_dim, width)
        self.o_norm = SigmoidGatedNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.o_proj = linear(width, hidden)
        self.states = RowStates(rows, {
            "conv": ((3 * width, cfg.linear_conv_kernel_dim - 1), dtype),
            "ssm": ((self.num_heads, self.head_dim, self.head_dim), torch.float32),
        })

    def decay(self, hidden: torch.Tensor) -> torch.Tensor:
        """The log decay per key channel, ``[T, H, Dk]`` float32."""
        f = (self.f_b_proj(self.f_a_proj(hidden)).float() + self.dt_bias.float()).view(-1, self.num_heads,
                                                                                        self.head_dim)
        return -self.A_log.float().view(self.num_heads, 1).exp() * _softplus(f)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: Any,
                metadata: AttentionMetadata) -> torch.Tensor:
        step = self.states.begin(metadata, hidden.device)
        tokens = hidden.shape[0]
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        g, beta = self.decay(hidden), self.b_proj(hidden).sigmoid().float()
        out = torch.zeros(tokens, self.num_heads, self.head_dim, dtype=hidden.dtype, device=hidden.device)
        run_rows(self, step, out, mixed, g, beta)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(tokens, self.num_heads, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).view(tokens, -1))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (t.reshape(mixed.shape[0], self.num_heads, self.head_dim) for t in mixed.split(self.width, -1))
        q, k = prepare_qk(q, k)
        return q, k, v.float()

    def _prefill(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, row: int, out: torch.Tensor) -> None:
        q, k, v = self._heads(causal_conv(mixed, self.states["conv"][row], self.conv1d))
        out.copy_(chunked_kda(self.states["ssm"][row], q, k, v, g, beta))

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One token of each of the rows' requests, all at once."""
        q, k, v = self._heads(conv_step(mixed, self.states["conv"], rows, self.conv1d))
        return kda_step(self.states["ssm"], rows, q, k, v, g, beta).to(mixed.dtype)
