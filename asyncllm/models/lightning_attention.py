"""Lightning attention (MiniMax-Text-01 / MiniMax-M1's ``linear_attention`` layers) with per-request recurrent state.

Linear attention with a fixed exponential decay per head: a layer keeps, per request and by worker row
(asyncllm/models/row_states.py), one ``[heads, head dim, head dim]`` float32 state ``S`` (the sum of the keys'
outer products with their values, each decayed by its age). Each token:

- projects to ``act(qkv_proj(x))`` (the config's ``hidden_act``, SiLU in the releases), each head's q, k and v side
  by side (no scaling, no normalization of q or k);
- updates ``S <- e^(-s) S + k v^T`` and outputs ``q S``, with head h's decay rate
  ``s_h = 2^(-8 (h + 1) / H) * (1 - layer_idx / (num_hidden_layers - 1) + 1e-5)`` (`decay_rates`: later layers
  forget slower, the last hardly at all);
- RMS-norms the heads' outputs together (over the whole ``H * head dim`` width, eps 1e-6, as transformers' fixed
  default), multiplies by ``sigmoid(output_gate(x))`` and projects them back with ``out_proj``.

A prefill chunk runs the rule in blocks of 64 tokens (`chunked_lightning`: within a block the decayed causal
product ``(q k^T * e^(-s (i - j)), j <= i) v`` plus the carried state's part ``e^(-s (i + 1)) q S``), a decode step
for every request at once on their state rows (`lightning_step`); both equal the token-by-token recurrence
(tests/unit/test_lightning_attention.py). transformers' ``block_size`` only sizes its own prefill blocks (the same
sums), so it is not read here. Every tensor-parallel rank computes the layer whole (its weights and states
replicated), as the other hybrids' state layers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.clip import activation
from asyncllm.models.gated_deltanet import blockwise, run_rows
from asyncllm.models.layers import RMSNorm, TensorParallel, head_dim_of
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.ops import REFERENCE_OPS, ModelOps
from asyncllm.models.row_states import RowStates, StateRows

__all__ = ["LightningAttention", "chunked_lightning", "decay_rates", "lightning_step"]

_NORM_EPS = 1e-6
"""The output norm's epsilon: transformers builds it with its default, not ``rms_norm_eps``."""


def decay_rates(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Each head's decay rate ``s`` (the state decays by ``e^-s`` a token), float32 ``[H]``, as transformers
    computes it (ALiBi's slopes, scaled down with depth)."""
    base = 1 / (2 ** (8 / num_heads))
    depth = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** (torch.arange(num_heads) + 1)).float() * depth


def lightning_step(states: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rates: torch.Tensor) -> torch.Tensor:
    """One token of each of N requests: ``states [R, H, D, D]`` float32 (request n's at row ``rows[n]``, updated),
    ``q, k, v [N, H, D]`` float32, ``rates [H]`` -> ``[N, H, D]``."""
    state = states[rows] * (-rates).exp()[:, None, None] + k.unsqueeze(-1) * v.unsqueeze(-2)
    states[rows] = state
    return (q.unsqueeze(-1) * state).sum(dim=-2)


def chunked_lightning(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      rates: torch.Tensor) -> torch.Tensor:
    """One request's ``T`` tokens: ``state [H, D, D]`` (updated in place), ``q, k, v [T, H, D]``, all float32,
    ``rates [H]`` -> output ``[T, H, D]``."""
    return blockwise(functools.partial(_block, rates=rates), state, q, k, v)


def _block(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           rates: torch.Tensor) -> torch.Tensor:
    """`chunked_lightning` on one block of C tokens, heads first (``[H, C, D]``): the outputs
    ``e^(-s (i + 1)) q_i S0 + sum_(j <= i) e^(-s (i - j)) (q_i . k_j) v_j``; the state
    ``e^(-s C) S0 + sum_j e^(-s (C - 1 - j)) k_j v_j^T``."""
    size = q.shape[1]
    steps = torch.arange(size, device=q.device, dtype=torch.float32)
    age = steps[:, None] - steps[None, :]
    s = rates[:, None, None]
    decay = torch.where(age >= 0, (-s * age.clamp(min=0)).exp(), 0.0)  # [H, i, j]
    out = (q * (-s * (steps[:, None] + 1)).exp()) @ state + (q @ k.transpose(-1, -2) * decay) @ v
    state.mul_((-s * size).exp()).add_((k * (-s * (size - 1 - steps[:, None])).exp()).transpose(-1, -2) @ v)
    return out


class LightningAttention(nn.Module):
    """A ``linear_attention`` layer of MiniMax (its checkpoint names: ``qkv_proj``, ``output_gate``, ``norm``,
    ``out_proj``)."""

    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, rows: StateRows,
                 ops: ModelOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, head_dim_of(cfg)
        width, hidden, whole = self.num_heads * self.head_dim, cfg.hidden_size, TensorParallel()
        self.qkv_proj = ColumnParallelLinear(hidden, 3 * width, False, whole, dtype)
        self.output_gate = ColumnParallelLinear(hidden, width, False, whole, dtype)
        self.norm = RMSNorm(width, _NORM_EPS, dtype, ops)
        self.out_proj = ColumnParallelLinear(width, hidden, False, whole, dtype)
        self.act = activation(cfg.hidden_act, "hidden_act")
        self.register_buffer("rates", decay_rates(self.num_heads, layer_idx, cfg.num_hidden_layers),
                             persistent=False)
        self.states = RowStates(rows, {"kv": ((self.num_heads, self.head_dim, self.head_dim), torch.float32)})

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: Any,
                metadata: AttentionMetadata) -> torch.Tensor:
        step = self.states.begin(metadata, hidden.device)
        tokens = hidden.shape[0]
        qkv = self.act(self.qkv_proj(hidden)).view(tokens, self.num_heads, 3 * self.head_dim)
        out = torch.zeros(tokens, self.num_heads, self.head_dim, dtype=hidden.dtype, device=hidden.device)
        run_rows(self, step, out, qkv)
        gated = self.output_gate(hidden).sigmoid() * self.norm(out.view(tokens, -1))
        return self.out_proj(gated)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.float() for t in qkv.split(self.head_dim, dim=-1))

    def _prefill(self, qkv: torch.Tensor, row: int, out: torch.Tensor) -> None:
        out.copy_(chunked_lightning(self.states["kv"][row], *self._heads(qkv), self.rates))

    def _decode(self, qkv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One token of each of the rows' requests, all at once."""
        return lightning_step(self.states["kv"], rows, *self._heads(qkv), self.rates).to(qkv.dtype)
