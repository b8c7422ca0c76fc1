"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder whose MoE layers add a shared
expert every token runs, scaled by a sigmoid gate."""

from __future__ import annotations

from typing import Any

from asyncllm.models.llama import DecoderFlags
from asyncllm.models.moe import MoECausalLM, MoESpec, num_experts_of
from asyncllm.models.qwen2 import Qwen2ForCausalLM
from asyncllm.models.qwen3_moe import qwen_moe_layer

__all__ = ["Qwen2MoeForCausalLM", "shared_expert_moe_spec"]


def shared_expert_moe_spec(hf_config: Any, layer_idx: int) -> MoESpec | None:
    """A Qwen MoE layer with a gated shared expert (Qwen2-MoE, Qwen3-Next), or None for a dense one."""
    if not qwen_moe_layer(hf_config, layer_idx):
        return None
    return MoESpec(num_experts_of(hf_config), hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                   renormalize=bool(hf_config.norm_topk_prob), weights_in_model_dtype=True,
                   shared_expert_size=hf_config.shared_expert_intermediate_size)


class Qwen2MoeForCausalLM(MoECausalLM, Qwen2ForCausalLM):
    lora_experts = True

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        return shared_expert_moe_spec(hf_config, layer_idx)
