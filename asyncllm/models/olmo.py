"""AllenAI OLMo (the first generation: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf, OLMo-7B-0724-hf): ``OlmoForCausalLM``.

Llama's layers (asyncllm/models/llama.py) under LayerNorms without a weight or a bias (`ParameterFreeLayerNorm`:
float32, eps 1e-5), and q, k and v each clamped to ``[-clip_qkv, clip_qkv]`` after their projection when the config
sets ``clip_qkv`` (the 0424 / 0724 releases).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.llama import DecoderBuild, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

__all__ = ["OlmoForCausalLM", "ParameterFreeLayerNorm"]


class ParameterFreeLayerNorm(nn.Module):
    """``layer_norm(x)`` in float32 without weight or bias, rounded back; ``forward(x, residual)`` adds the residual
    first and returns both, as `RMSNorm`."""

    def __init__(self, hidden_size: int, *args: Any) -> None:
        super().__init__()
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        out = F.layer_norm(x.float(), self.shape, None, None, 1e-5).to(x.dtype)
        return out if residual is None else (out, x)


class OlmoAttention(LlamaAttention):
    """Llama's attention with q, k and v clamped after the projection (``clip_qkv``)."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.clip = getattr(b.hf_config, "clip_qkv", None)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        return super().attend(positions, qkv, kv_cache, metadata)


class OlmoDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoAttention

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.input_layernorm = ParameterFreeLayerNorm(b.hf_config.hidden_size)
        self.post_attention_layernorm = ParameterFreeLayerNorm(b.hf_config.hidden_size)
        self.fused_decode_rows = 0  # the fused decode products run RMSNorms with weights


class OlmoModel(LlamaModel):
    layer_cls = OlmoDecoderLayer
    norm_cls = ParameterFreeLayerNorm


class OlmoForCausalLM(LlamaForCausalLM):
    """Llama's layers with parameter-free LayerNorms and optional q/k/v clamping."""

    model_cls = OlmoModel

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        config = copy.copy(hf_config)
        config.rms_norm_eps = 1e-5  # what the shared layers read; the norms here fix it
        super().__init__(config, **kwargs)
