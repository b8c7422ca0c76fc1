"""NVIDIA Nemotron (Nemotron-4-Minitron-4B / 8B, Mistral-NeMo-Minitron-8B, Nemotron-4-340B in its HF form):
``NemotronForCausalLM``.

Llama's pre-norm layers (asyncllm/models/llama.py) with LayerNorms whose weight is stored minus one
(`LayerNorm1P`: ``layer_norm(x, w + 1, b)``, ``norm_eps``), a gateless squared-ReLU MLP (Arcee's:
asyncllm/models/ernie_seed_arcee.py), biases by ``attention_bias`` and ``mlp_bias``, and a partial rotary
(``partial_rotary_factor``, 0.5), half-split within the rotated dims as the backends turn them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models.ernie_seed_arcee import ArceeMLP
from asyncllm.models.layers import num_kv_heads_of
from asyncllm.models.llama import DecoderBuild, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncllm.models.starcoder2 import BiasLayerNorm

__all__ = ["LayerNorm1P", "NemotronForCausalLM"]


class LayerNorm1P(BiasLayerNorm):
    """`BiasLayerNorm` with the weight plus one (added in the weight's dtype, as transformers does)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        out = F.layer_norm(x, (x.shape[-1],), self.weight + 1.0, self.bias, self.eps)
        return out if residual is None else (out, x)


class NemotronDecoderLayer(LlamaDecoderLayer):
    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.input_layernorm = LayerNorm1P(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.post_attention_layernorm = LayerNorm1P(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)


class NemotronModel(LlamaModel):
    layer_cls = NemotronDecoderLayer
    norm_cls = LayerNorm1P


class NemotronForCausalLM(LlamaForCausalLM):
    """Llama's layers with LayerNorm1P norms and a squared-ReLU MLP."""

    model_cls = NemotronModel
    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return ArceeMLP(b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        hf_config = copy.copy(hf_config)
        hf_config.rms_norm_eps = hf_config.norm_eps  # every norm's eps, as the shared layers build them
        hf_config.num_key_value_heads = num_kv_heads_of(hf_config)
        super().__init__(hf_config, **kwargs)
