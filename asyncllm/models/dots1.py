"""rednote dots.llm1 (``Dots1ForCausalLM``: dots.llm1.base / .inst): Qwen3's attention (per-head q/k RMSNorms, biases
when ``attention_bias``, sliding-window layers by ``layer_types``) over DeepSeek-V3's experts (dense first layers,
grouped sigmoid routing with the score correction, shared experts: asyncllm/models/deepseek_moe.py)."""

from __future__ import annotations

from typing import Any

from asyncllm.models.deepseek import DeepseekExperts
from asyncllm.models.deepseek_moe import check_routing
from asyncllm.models.llama import DecoderFlags, LlamaForCausalLM

__all__ = ["Dots1ForCausalLM"]


class Dots1ForCausalLM(DeepseekExperts, LlamaForCausalLM):
    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_routing(hf_config)
        super().__init__(hf_config, **kwargs)
