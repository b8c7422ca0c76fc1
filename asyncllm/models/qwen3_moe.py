"""Qwen3-MoE: the Qwen3 decoder whose MLPs are mixtures of experts, except the layers in
``mlp_only_layers`` and those off the ``decoder_sparse_step`` stride (dense MLPs)."""

from __future__ import annotations

from typing import Any

from asyncllm.models.moe import MoECausalLM, MoESpec, num_experts_of
from asyncllm.models.qwen3 import Qwen3ForCausalLM

__all__ = ["Qwen3MoeForCausalLM", "qwen_moe_layer"]


def qwen_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether a Qwen MoE layer routes to experts (transformers' rule)."""
    sparse_step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = getattr(hf_config, "mlp_only_layers", None) or []
    return (layer_idx not in dense and num_experts_of(hf_config) > 0
            and (layer_idx + 1) % sparse_step == 0)


class Qwen3MoeForCausalLM(MoECausalLM, Qwen3ForCausalLM):
    lora_experts = True

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if not qwen_moe_layer(hf_config, layer_idx):
            return None
        return MoESpec(num_experts_of(hf_config), hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                       renormalize=bool(hf_config.norm_topk_prob), weights_in_model_dtype=True)
