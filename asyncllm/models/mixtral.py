"""Mixtral: the Llama decoder with a mixture of experts in every layer (``block_sparse_moe``, experts
``w1`` gate, ``w3`` up, ``w2`` down), top-k probabilities always renormalised."""

from __future__ import annotations

from typing import Any

from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.moe import MoECausalLM, MoESpec, num_experts_of

__all__ = ["MixtralForCausalLM"]


class MixtralForCausalLM(MoECausalLM, LlamaForCausalLM):
    lora_experts = True
    moe_module = "block_sparse_moe"
    expert_parts = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        return MoESpec(num_experts_of(hf_config), hf_config.num_experts_per_tok, hf_config.intermediate_size,
                       renormalize=True, weights_in_model_dtype=False)
