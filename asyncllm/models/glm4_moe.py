"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (``Glm4MoeForCausalLM``): Llama's attention with q/k/v biases, an optional
RMSNorm on each query and key head (``use_qk_norm``, Qwen3's) and a half-split rotary over the first half of each
head (``partial_rotary_factor`` 0.5: Phi-3's path, unlike GLM-4's interleaved pairs); dense first layers
(``first_k_dense_replace``), then DeepSeek-V3's mixture of experts: grouped sigmoid routing with the score
correction and shared experts (asyncllm/models/deepseek_moe.py). The checkpoints' multi-token-prediction layers
(indices past ``num_hidden_layers``) are left unread, as transformers does."""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch

from asyncllm.models.deepseek import DeepseekExperts
from asyncllm.models.deepseek_moe import check_routing
from asyncllm.models.layers import LoadedWeight, head_dim_of
from asyncllm.models.llama import DecoderFlags, LlamaForCausalLM

__all__ = ["Glm4MoeForCausalLM", "SolarOpenForCausalLM", "sarvam_names"]


class Glm4MoeForCausalLM(DeepseekExperts, LlamaForCausalLM):
    """GLM-4.5's layers: Llama attention (biased q/k/v, per-head q/k norms, half the head rotated), DeepSeek-V3's
    experts."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(hf_config.attention_bias), qk_norm=bool(hf_config.use_qk_norm))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_routing(hf_config)
        super().__init__(hf_config, **kwargs)
        head_dim = head_dim_of(hf_config)
        self.qkv_rows = (hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim)
        self.sarvam = hf_config.model_type == "sarvam_moe"
        """Sarvam-30B / 105B: GLM-4.5's layers under their own checkpoint names (`sarvam_names`)."""

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(sarvam_names(weights, *self.qkv_rows) if self.sarvam else weights)


_SARVAM_NAMES = ((r"^model\.word_embeddings\.", "model.embed_tokens."), (r"\.attention\.", ".self_attn."),
                 (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
                 (r"\.self_attn\.query_layernorm\.", ".self_attn.q_norm."),
                 (r"\.self_attn\.key_layernorm\.", ".self_attn.k_norm."),
                 (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias"))


def sarvam_names(weights: Iterable[tuple[str, LoadedWeight]], q_rows: int,
                 kv_rows: int) -> Iterator[tuple[str, LoadedWeight]]:
    """Sarvam's checkpoint names as GLM-4.5's (transformers' own renaming), its fused ``query_key_value`` rows
    ``[q | k | v]`` cut into the three projections."""
    for name, weight in weights:
        for pattern, new in _SARVAM_NAMES:
            name = re.sub(pattern, new, name)
        prefix, fused, leaf = name.rpartition(".self_attn.query_key_value.")
        if not fused:
            yield name, weight
            continue
        full = weight if isinstance(weight, torch.Tensor) else weight[...]
        for part, rows in zip(("q_proj", "k_proj", "v_proj"), full.split([q_rows, kv_rows, kv_rows])):
            yield f"{prefix}.self_attn.{part}.{leaf}", rows


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    """Upstage Solar Open (Solar-Open-100B): GLM-4.5's experts in every layer under Llama attention (no biases, no
    q/k norms), the rotary as GLM-4.5's (its config's ``partial_rotary_factor``)."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags()
