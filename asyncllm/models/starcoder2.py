"""BigCode StarCoder2 (starcoder2-3b / 7b / 15b, and their instruct fine-tunes): ``Starcoder2ForCausalLM``.

Llama's attention (asyncllm/models/llama.py), with biases on q, k, v and o (``use_bias``), in a GPT-style layer:
LayerNorms with a bias (``norm_epsilon``) before attention, before the MLP and at the end, and a gateless MLP
``c_proj(gelu_tanh(c_fc(x)))`` with biases. Sliding windows follow ``sliding_window`` as Mistral's.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.clip import quick_gelu
from asyncllm.models.layers import RMSNorm, new_param
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

__all__ = ["BiasLayerNorm", "GatelessMLP", "Starcoder2ForCausalLM"]

_ACTIVATIONS = {"gelu": functools.partial(F.gelu, approximate="none"), "relu": F.relu,
                "quick_gelu": quick_gelu,  # CLIP's text transformer
                **dict.fromkeys(("gelu_pytorch_tanh", "gelu_new", "gelu_fast"),
                                functools.partial(F.gelu, approximate="tanh"))}
"""transformers' activations of the gateless MLPs (its tanh GELUs agree with torch's to rounding)."""


class BiasLayerNorm(RMSNorm):
    """``torch.nn.LayerNorm`` with its bias, in the input's dtype as transformers runs it; ``forward(x, residual)``
    adds the residual first and returns both, as `RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, *args: Any) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.bias = new_param(hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        out = F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return out if residual is None else (out, x)


class GatelessMLP(nn.Module):
    """``c_proj(act(c_fc(x)))`` (GPT-style; exact or tanh GELU, or ReLU, by ``hidden_act``): StarCoder2's and
    GPT-2's, and Phi's, GPT-NeoX's and OPT's under their own names (renamed at load)."""

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        if cfg.hidden_act not in _ACTIVATIONS:
            raise NotBuiltError("model", cfg.hidden_act, f"a gateless MLP's activation, one of {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, b.flags.mlp_bias, b.tp, b.dtype)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, b.flags.mlp_bias, b.tp, b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.input_layernorm = BiasLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.post_attention_layernorm = BiasLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.fused_decode_rows = 0  # the fused decode products run RMSNorms


class Starcoder2Model(LlamaModel):
    layer_cls = Starcoder2DecoderLayer
    norm_cls = BiasLayerNorm


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """Llama's attention with biases; LayerNorms with biases; a gateless GELU MLP."""

    model_cls = Starcoder2Model
    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "use_bias", True))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bias)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GatelessMLP(b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        hf_config = copy.copy(hf_config)
        hf_config.rms_norm_eps = hf_config.norm_epsilon  # every norm's eps, as the Llama layers build them
        super().__init__(hf_config, **kwargs)
