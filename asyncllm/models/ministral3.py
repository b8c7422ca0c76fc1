"""Mistral's Ministral 3 (Ministral-3-3B / 8B / 14B, base, instruct and reasoning; the language model of their
``Mistral3ForConditionalGeneration`` checkpoints and of ``Ministral3ForCausalLM``), and Ministral-8B-2410
(``MinistralForCausalLM``: Mistral's layers with a sliding window per ``layer_types``, served as Llama).

Ministral 3 is Mistral's decoder (asyncllm/models/llama.py) with a YaRN rope and Llama 4's attention
temperature: each query is multiplied by ``1 + beta * log(1 + floor(position / original_max_position_embeddings))``
(``rope_parameters["llama_4_scaling_beta"]``), 1 within the first ``original_max_position_embeddings`` positions.
transformers multiplies the rotated query; here the query is multiplied before the backend rotates it (the
rotation is linear, so only the rounding of a low-precision dtype may differ, and only past that many positions).
"""

from __future__ import annotations

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.llama import DecoderBuild, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncllm.models.rotary import rope_parameters

__all__ = ["Ministral3ForCausalLM", "attention_temperature"]


def attention_temperature(positions: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """Llama 4's per-position query scale ``[T, 1, 1]`` float32."""
    return (1 + beta * torch.log1p(torch.floor(positions.float() / original)))[:, None, None]


class Ministral3Attention(LlamaAttention):
    """Llama's attention; queries past ``original_max_position_embeddings`` scaled up (`attention_temperature`)."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        params = rope_parameters(b.hf_config)
        self.beta = float(params.get("llama_4_scaling_beta") or 0.0)
        self.original = int(params.get("original_max_position_embeddings") or b.hf_config.max_position_embeddings)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        if not self.beta:
            return super().attend(positions, qkv, kv_cache, metadata)
        query, key, value = self.qkv_proj.split_qkv(qkv)
        query = query * attention_temperature(positions, self.beta, self.original).to(query.dtype)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata, self._rotary_inputs(positions)))


class Ministral3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Ministral3Attention


class Ministral3Model(LlamaModel):
    layer_cls = Ministral3DecoderLayer


class Ministral3ForCausalLM(LlamaForCausalLM):
    """Mistral's layers with Llama 4's attention temperature."""

    model_cls = Ministral3Model
