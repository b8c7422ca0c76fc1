"""Swiss AI Apertus (``ApertusForCausalLM``: Apertus-8B / 70B, base and instruct): Llama's layers with per-head q/k
RMSNorms (fused in the backend's rotary kernel as Qwen3's), its norms named ``attention_layernorm`` /
``feedforward_layernorm``, and a gateless MLP ``down(xielu(up x))``.

xIELU (arXiv 2411.13010) has two learned scalars per layer (``act_fn.alpha_p``, ``act_fn.alpha_n``) and two
constants (``beta``, ``eps``) in the checkpoint: ``alpha_p x^2 + beta x`` for ``x > 0``, else
``(expm1(min(x, eps)) - x) alpha_n + beta x``, with ``alpha_p = softplus(alpha_p)`` and ``alpha_n = beta +
softplus(alpha_n)``, computed as transformers' Python form does.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.hybrid import renamed
from asyncllm.models.layers import LoadedWeight, new_param
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM

__all__ = ["ApertusForCausalLM"]

_NAMES = ((".attention_layernorm.", ".input_layernorm."), (".feedforward_layernorm.", ".post_attention_layernorm."))


class XIELU(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.alpha_p, self.alpha_n = new_param(1, dtype=dtype), new_param(1, dtype=dtype)
        self.beta, self.eps = new_param(dtype=dtype), new_param(dtype=dtype)  # scalars

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


class ApertusMLP(nn.Module):
    """``down(xielu(up x))``: ``up_proj`` column-parallel, ``down_proj`` row-parallel."""

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        if cfg.hidden_act != "xielu":
            raise NotBuiltError("hidden_act", cfg.hidden_act, "Apertus with its xIELU activation")
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, b.flags.mlp_bias, b.tp, b.dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, b.flags.mlp_bias, b.tp, b.dtype)
        self.act_fn = XIELU(b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusForCausalLM(LlamaForCausalLM):
    """Llama's layers with q/k norms and the xIELU MLP."""

    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }
    """Only q/k/v are fused (the MLP has no gate)."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(hf_config.attention_bias)
        return DecoderFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return ApertusMLP(b)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((renamed(name, _NAMES), w) for name, w in weights)
