"""The Mamba (v1) selective-scan mixer (Jamba: asyncllm/models/jamba.py): a per-channel diagonal state
``[inner, state]`` per request, kept by worker row (asyncllm/models/row_states.py).

``in_proj`` gives ``x`` and the gate ``z``; ``x`` goes through the causal depthwise convolution (SiLU); ``x_proj``
gives the low-rank step ``dt`` and ``B``, ``C`` (Jamba RMS-norms each), ``dt_proj`` lifts ``dt`` to every channel
(its bias added inside the softplus); per token ``h <- exp(dt A) h + dt B x``, ``y = h C + D x``, out
``out_proj(y * silu(z))``. A prefill chunk scans token by token (vectorized over channels and states); a step where
every request decodes one token updates all their states at once. It runs in PyTorch on every device. LoRA
adapters (attention-free Mamba's: asyncllm/models/mamba.py) on ``x_proj`` and ``dt_proj``, which run on a chunk's or
a decode position's tokens only, take those tokens' rows of the step's adapter mask (`_adapted`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import RMSNorm, TensorParallel, new_param
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.row_states import DepthwiseConv, RowStates, StateRows, causal_conv, conv_step

__all__ = ["Mamba1Mixer", "selective_scan", "selective_step"]


def selective_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor) -> torch.Tensor:
    """One token of N requests: ``state [N, I, S]`` (updated), float32 ``x``, ``dt`` ``[N, I]``, ``b``, ``c``
    ``[N, S]`` -> ``h C`` ``[N, I]``."""
    state.mul_(torch.exp(dt.unsqueeze(-1) * a)).add_((dt * x).unsqueeze(-1) * b.unsqueeze(1))
    return torch.einsum("nis,ns->ni", state, c)


def selective_scan(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor) -> torch.Tensor:
    """One request's chunk from ``state [I, S]`` (updated): float32 ``x``, ``dt`` ``[T, I]``, ``b``, ``c``
    ``[T, S]`` -> ``[T, I]``."""
    decay = torch.exp(dt.unsqueeze(-1) * a)  # [T, I, S]
    writes = (dt * x).unsqueeze(-1) * b.unsqueeze(1)
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        state.mul_(decay[t]).add_(writes[t])
        out[t] = state @ c[t]
    return out


def _weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Falcon Mamba's norm of ``dt``, ``B``, ``C``: ``x * rsqrt(mean(x^2) + eps)`` in float32, no weight."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Mamba1Mixer(nn.Module):
    """Every tensor-parallel rank computes it whole (its projections are not split)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, rows: StateRows, ops: Any, inner_norms: str = "learned") -> None:
        """``inner_norms``: how ``dt``, ``B`` and ``C`` are normed after ``x_proj``: ``"learned"`` RMSNorms (Jamba),
        ``"weightless"`` ones in float32 (Falcon Mamba, ``mixer_rms_eps``), or ``"none"`` (Mamba)."""
        super().__init__()
        hidden, inner = cfg.hidden_size, int(cfg.mamba_expand * cfg.hidden_size)
        self.inner, self.rank, self.state_size = inner, int(cfg.mamba_dt_rank), int(cfg.mamba_d_state)
        whole, bias = TensorParallel(), bool(cfg.mamba_proj_bias)
        self.in_proj = ColumnParallelLinear(hidden, 2 * inner, bias, whole, dtype)
        self.conv1d = DepthwiseConv(inner, cfg.mamba_d_conv, bool(cfg.mamba_conv_bias), dtype)
        self.x_proj = ColumnParallelLinear(inner, self.rank + 2 * self.state_size, False, whole, dtype)
        self.dt_proj = ColumnParallelLinear(self.rank, inner, True, whole, dtype)
        self.A_log = new_param(inner, self.state_size, dtype=dtype)
        self.D = new_param(inner, dtype=dtype)
        self.out_proj = ColumnParallelLinear(inner, hidden, bias, whole, dtype)
        self.inner_norms, eps = inner_norms, cfg.rms_norm_eps
        if inner_norms == "learned":
            self.dt_layernorm = RMSNorm(self.rank, eps, dtype, ops)
            self.b_layernorm = RMSNorm(self.state_size, eps, dtype, ops)
            self.c_layernorm = RMSNorm(self.state_size, eps, dtype, ops)
        else:
            norm = _weightless_rms if inner_norms == "weightless" else (lambda x, eps: x)
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = lambda x: norm(x, eps)  # noqa: E731
        self.states = RowStates(rows, {
            "conv": ((inner, cfg.mamba_d_conv - 1), dtype),
            "ssm": ((inner, self.state_size), torch.float32),
        })

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: Any,
                metadata: AttentionMetadata) -> torch.Tensor:
        step = self.states.begin(metadata, hidden.device)
        x, gate = self.in_proj(hidden).chunk(2, dim=-1)
        a = -self.A_log.float().exp()
        y = torch.zeros(hidden.shape[0], self.inner, device=hidden.device)
        if step.decode_only:
            n = len(step.rows)
            y[:n] = self._decode(x[:n], a, step.rows, slice(0, n))
            self.states.save_decoded(step)
        else:
            for rows, index in self.states.positions(step):  # decodes and drafted requests
                y[index] = self._decode(x[index], a, rows, index)
            for row, span in self.states.spans(step):
                xc = causal_conv(x[span], self.states["conv"][row], self.conv1d)
                dt, b, c = self._ssm_inputs(xc, span)
                y[span] = selective_scan(self.states["ssm"][row], xc.float(), dt, a, b, c) + xc * self.D
        return self.out_proj((y * F.silu(gate)).to(hidden.dtype))

    def _decode(self, x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor,
                tokens: slice | torch.Tensor) -> torch.Tensor:
        """One token of each of the rows' requests (``tokens``: theirs in the step) from their states (updated):
        ``[N, I]``."""
        xc = conv_step(x, self.states["conv"], rows, self.conv1d)
        dt, b, c = self._ssm_inputs(xc, tokens)
        state = self.states["ssm"][rows]
        y = selective_step(state, xc.float(), dt, a, b, c) + xc * self.D
        self.states["ssm"][rows] = state
        return y

    def _ssm_inputs(self, xc: torch.Tensor, tokens: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
        """The convolved ``x [T, I]`` of the step's ``tokens`` -> float32 ``dt`` (softplus of the lifted step plus
        its bias) ``[T, I]``, ``B``, ``C`` ``[T, S]``, each normed as the family norms them (``inner_norms``)."""
        low, b, c = _adapted(self.x_proj, xc, tokens).split([self.rank, self.state_size, self.state_size], dim=-1)
        lifted = _adapted(self.dt_proj, self.dt_layernorm(low), tokens)
        dt = F.softplus(lifted.float() + self.dt_proj.bias.float())
        return dt, self.b_layernorm(b).float(), self.c_layernorm(c).float()


def _adapted(proj: ColumnParallelLinear, x: torch.Tensor, tokens: slice | torch.Tensor) -> torch.Tensor:
    """``x W^T`` (no bias) for some of the step's tokens (``tokens``: theirs), plus their adapters' products (LoRA:
    asyncllm/models/lora.py)."""
    out = proj.matmul(x, None)
    return out if proj.lora is None else proj.lora(x, out, tokens)
