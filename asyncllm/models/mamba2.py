"""The Mamba2 mixer (Granite 4.0's ``mamba`` layers, Nemotron-H's) with per-request states by worker row
(asyncllm/models/row_states.py).

``in_proj`` gives a gate ``z``, the convolution's input (x, then the groups' B and C) and a step size per head;
after the causal convolution (SiLU), each head ``h`` with ``dt = softplus(dt + dt_bias)`` (clamped to
``time_step_limit`` in prefill chunks, as transformers) and ``A = -exp(A_log)`` updates its ``[head dim, state]``
state ``S <- exp(dt A) S + dt x B^T`` and outputs ``y = S C + D x`` (B and C shared by the heads of a group). ``y *
silu(z)`` is RMS-normed per group, then ``out_proj``. A prefill chunk runs the scan in blocks of 64 tokens
(`ssd_chunk`: the quadratic form within a block, the state carried across), a decode step for every request at once
on the requests' state rows in place (`ModelOps.ssd_decode_step`: torch, or kernels/ssd_step.py with the
triton backend); both equal the token-by-token recurrence and transformers' float32 results
(tests/unit/test_mamba2.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import TensorParallel, new_param
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.ops import REFERENCE_OPS, ModelOps
from asyncllm.models.row_states import DepthwiseConv, RowStates, StateRows, causal_conv, conv_step

__all__ = ["Mamba2Mixer", "Mamba2Shape", "granite_mamba", "ssd_chunk"]

_BLOCK = 64


def ssd_chunk(state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
              a: torch.Tensor) -> torch.Tensor:
    """One request's T tokens, float32: ``state [H, P, S]`` (updated in place), ``x [T, H, P]``, ``b, c [T, H, S]``,
    ``dt [T, H]``, ``a [H]`` -> ``[T, H, P]`` (without ``D x``). In a block with cumulative log decay ``l_i``:
    ``y_i = e^(l_i) S0 c_i + sum_(j <= i) e^(l_i - l_j) dt_j (c_i . b_j) x_j``, and the state
    ``e^(l_L) S0 + sum_j e^(l_L - l_j) dt_j x_j b_j^T``."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], _BLOCK):
        block = slice(start, start + _BLOCK)
        out[block] = _block(state, x[block], b[block], c[block], dt[block], a)
    return out


def _block(state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
           a: torch.Tensor) -> torch.Tensor:
    size = x.shape[0]
    log_decay = (dt * a).cumsum(dim=0)  # [L, H]
    below = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    pairs = (log_decay.t().unsqueeze(-1) - log_decay.t().unsqueeze(-2)).masked_fill(~below, float("-inf")).exp()
    scores = torch.einsum("ihs,jhs->hij", c, b) * pairs * dt.t().unsqueeze(1)
    out = torch.einsum("hij,jhp->ihp", scores, x)
    out += torch.einsum("hps,ihs->ihp", state, c) * log_decay.exp().unsqueeze(-1)
    last = log_decay[-1]
    weights = ((last - log_decay).exp() * dt).unsqueeze(-1)  # [L, H, 1]
    state.mul_(last.exp()[:, None, None]).add_(torch.einsum("jhp,jhs->hps", x * weights, b))
    return out


class GroupGatedRMSNorm(nn.Module):
    """``x * silu(gate)`` RMS-normed per group of ``group_size`` features in float32, times the weight; with
    ``gate_last`` (Falcon-H1's ``mamba_norm_before_gate``) normed first, times the weight, then gated."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype, gate_last: bool = False) -> None:
        super().__init__()
        self.weight = new_param(size, dtype=dtype)
        self.group_size, self.eps, self.gate_last = group_size, eps, gate_last

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = x.float() if self.gate_last else x.float() * F.silu(gate.float())
        grouped = gated.unflatten(-1, (-1, self.group_size))
        normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        if self.gate_last:
            return (self.weight * normed * F.silu(gate.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class SiluGate(nn.Module):
    """``x * silu(gate)`` without a norm (Falcon-H1 without ``mamba_rms_norm``)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x * F.silu(gate.to(x.dtype))


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 layer's sizes and switches, whichever config names them (`granite_mamba`, `nemotron_mamba`)."""

    hidden: int
    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    dt_limit: tuple[float, float]
    """``dt`` is clamped to it in prefill chunks (transformers' chunked scan; its one-token step does not clamp)."""
    norm: str = "gate_norm"
    """The output's gate and norm: ``gate_norm`` (gated, then RMS-normed per group), ``norm_gate`` (normed, then
    gated) or ``gate`` (gated, no norm)."""
    out_bias: bool | None = None
    """``out_proj``'s bias (None: ``proj_bias``, as ``in_proj``'s)."""


def granite_mamba(cfg: Any) -> Mamba2Shape:
    """Granite 4.0's names (``mamba_*``; the inner width ``mamba_expand * hidden_size``)."""
    return Mamba2Shape(cfg.hidden_size, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state,
                       cfg.mamba_d_conv, bool(cfg.mamba_conv_bias), bool(cfg.mamba_proj_bias), cfg.rms_norm_eps,
                       tuple(getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))))


class Mamba2Mixer(nn.Module):
    """A Mamba2 layer; every tensor-parallel rank computes it whole (its projections are not split)."""

    def __init__(self, shape: Mamba2Shape, dtype: torch.dtype, rows: StateRows, ops: ModelOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.num_heads, self.head_dim = shape.heads, shape.head_dim
        self.groups, self.state_size = shape.groups, shape.state
        self.inner = shape.heads * shape.head_dim
        conv_dim = self.inner + 2 * self.groups * self.state_size
        whole, bias = TensorParallel(), shape.proj_bias
        self.in_proj = ColumnParallelLinear(shape.hidden, self.inner + conv_dim + self.num_heads, bias, whole, dtype)
        self.conv1d = DepthwiseConv(conv_dim, shape.conv_kernel, shape.conv_bias, dtype)
        self.dt_bias = new_param(self.num_heads, dtype=dtype)
        self.A_log = new_param(self.num_heads, dtype=dtype)
        self.D = new_param(self.num_heads, dtype=dtype)
        self.norm = SiluGate() if shape.norm == "gate" else GroupGatedRMSNorm(
            self.inner, self.inner // self.groups, shape.eps, dtype, gate_last=shape.norm == "norm_gate")
        out_bias = bias if shape.out_bias is None else shape.out_bias
        self.out_proj = ColumnParallelLinear(self.inner, shape.hidden, out_bias, whole, dtype)
        self.dt_limit = shape.dt_limit
        self.ssd_decode_step = ops.ssd_decode_step
        """The decode step over the requests' state rows (torch, or the Triton kernel with the triton backend)."""
        self.states = RowStates(rows, {
            "conv": ((conv_dim, shape.conv_kernel - 1), dtype),
            "ssm": ((self.num_heads, self.head_dim, self.state_size), torch.float32),
        })

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: Any,
                metadata: AttentionMetadata) -> torch.Tensor:
        step = self.states.begin(metadata, hidden.device)
        gate, xbc, dt = self.in_proj(hidden).split([self.inner, xbc_width(self), self.num_heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        a = -self.A_log.float().exp()
        y = torch.zeros(hidden.shape[0], self.num_heads, self.head_dim, device=hidden.device)
        if step.decode_only:
            n = len(step.rows)
            y[:n] = self._decode(xbc[:n], dt[:n], a, step.rows)
            self.states.save_decoded(step)
        else:
            for rows, index in self.states.positions(step):  # decodes and drafted requests
                y[index] = self._decode(xbc[index], dt[index], a, rows)
            dt = dt.clamp(*self.dt_limit).float()
            for row, span in self.states.spans(step):
                y[span] = self._prefill(xbc[span], dt[span], a, row)
        return self.out_proj(self.norm(y.view(hidden.shape[0], -1), gate).to(hidden.dtype))

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One token of each of the rows' requests from their states (updated): ``[N, H, P]``."""
        x, b, c = self._split(conv_step(xbc, self.states["conv"], rows, self.conv1d))
        return self.ssd_decode_step(self.states["ssm"], rows, x, b, c, dt.float(), a) + x * self.D.float()[:, None]

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, row: int) -> torch.Tensor:
        """One request's chunk from its row's states (updated): ``[T, H, P]``."""
        x, b, c = self._split(causal_conv(xbc, self.states["conv"][row], self.conv1d))
        return ssd_chunk(self.states["ssm"][row], x, b, c, dt, a) + x * self.D.float()[:, None]

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output -> float32 x ``[T, H, P]`` and the groups' B, C repeated per head
        ``[T, H, S]``."""
        width = self.groups * self.state_size
        x, b, c = xbc.float().split([self.inner, width, width], dim=-1)
        per_group = self.num_heads // self.groups
        b, c = (t.unflatten(-1, (self.groups, self.state_size)).repeat_interleave(per_group, dim=1) for t in (b, c))
        return x.unflatten(-1, (self.num_heads, self.head_dim)), b, c


def xbc_width(mixer: Mamba2Mixer) -> int:
    """The convolution's channels: x, then the groups' B and C."""
    return mixer.inner + 2 * mixer.groups * mixer.state_size
