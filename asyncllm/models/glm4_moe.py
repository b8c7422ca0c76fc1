"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (``Glm4MoeForCausalLM``): Llama's attention with q/k/v biases, an optional
RMSNorm on each query and key head (``use_qk_norm``, Qwen3's) and a half-split rotary over the first half of each
head (``partial_rotary_factor`` 0.5: Phi-3's path, unlike GLM-4's interleaved pairs); dense first layers
(``first_k_dense_replace``), then DeepSeek-V3's mixture of experts: grouped sigmoid routing with the score
correction and shared experts (asyncllm/models/deepseek.py). The checkpoints' multi-token-prediction layers
(indices past ``num_hidden_layers``) are left unread, as transformers does."""

from __future__ import annotations

from typing import Any

from asyncllm.models.deepseek import DeepseekExperts, check_routing
from asyncllm.models.llama import DecoderFlags, LlamaForCausalLM

__all__ = ["Glm4MoeForCausalLM", "SolarOpenForCausalLM"]


class Glm4MoeForCausalLM(DeepseekExperts, LlamaForCausalLM):
    """GLM-4.5's layers: Llama attention (biased q/k/v, per-head q/k norms, half the head rotated), DeepSeek-V3's
    experts."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(hf_config.attention_bias), qk_norm=bool(hf_config.use_qk_norm))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_routing(hf_config)
        super().__init__(hf_config, **kwargs)


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    """Upstage Solar Open (Solar-Open-100B): GLM-4.5's experts in every layer under Llama attention (no biases, no
    q/k norms), the rotary as GLM-4.5's (its config's ``partial_rotary_factor``)."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags()
