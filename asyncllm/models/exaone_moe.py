"""LG AI Research EXAONE MoE (``ExaoneMoeForCausalLM``: K-EXAONE): EXAONE 4.0's attention (per-head q/k RMSNorms;
with a ``sliding_window``, only the sliding-window layers rotate, the global ones use no positions) in Llama's
pre-norm layers, over DeepSeek-V3's experts (dense layers by ``mlp_layer_types``, grouped sigmoid routing with the
score correction, ``num_shared_experts`` shared experts: asyncllm/models/deepseek_moe.py), as dots.llm1 (dots1.py) with
EXAONE's names for the experts (``num_experts``, ``num_shared_experts``). Experts load per expert or stacked as
transformers 5 holds them (``[E, 2I, H]``, `MoECausalLM`); the
multi-token-prediction block (``mtp.*``) is left unread, as transformers leaves it."""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch

from asyncllm.attention.selector import AttentionBackend
from asyncllm.models.deepseek_moe import check_routing
from asyncllm.models.dots1 import Dots1ForCausalLM
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llama import DecoderBuild, with_rope_only_in
from asyncllm.models.moe import MoESpec

__all__ = ["ExaoneMoeForCausalLM"]


def deepseek_names(hf_config: Any) -> Any:
    """The config with DeepSeek's names for its experts, as the shared DeepSeek layers read them."""
    config = copy.copy(hf_config)
    config.n_routed_experts = hf_config.num_experts
    config.n_shared_experts = getattr(hf_config, "num_shared_experts", 0) or 0
    return config


class ExaoneMoeForCausalLM(Dots1ForCausalLM):
    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        return super().moe_spec(deepseek_names(hf_config), layer_idx)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        if getattr(hf_config, "sliding_window", None) is None:
            return build
        return with_rope_only_in(build, [kind == "sliding_attention" for kind in hf_config.layer_types], max_position)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        config = deepseek_names(hf_config)
        check_routing(config)
        super().__init__(config, **kwargs)

    def unread_weight(self, name: str) -> bool:
        return name.startswith("mtp.") or super().unread_weight(name)  # the multi-token-prediction block

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        renamed = ((name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"), w)
                   for name, w in weights  # EXAONE keeps the score correction beside the router, not in it
                   if not self.unread_weight(name))
        return super().load_weights(renamed)  # stacked experts: transformers 5's [E, 2I, H] (`MoECausalLM`)
