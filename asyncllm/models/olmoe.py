"""AllenAI OLMoE (OLMoE-1B-7B-0924 / 0125, Instruct): ``OlmoeForCausalLM``.

Llama's pre-norm layers (asyncllm/models/llama.py) with OLMo 2's q and k norms over the whole projection
(`WholeProjectionRMSNorm`, all-reduced over tensor-parallel ranks; Llama's rounding order here) and a mixture
of experts in every layer (asyncllm/models/moe.py): the softmax's top k, renormalised when ``norm_topk_prob``,
rounded to the model dtype, as Qwen-MoE's. ``clip_qkv`` (no released OLMoE sets it) is a `NotBuiltError`.

AllenAI FlexOlmo (FlexOlmo-7x7B-1T, -RT): ``FlexOlmoForCausalLM``. OLMo 2's layers (asyncllm/models/olmo2.py:
norms after the sublayers, whole-projection q/k norms with OLMo 2's rounding) with OLMoE's experts in every layer.
"""

from __future__ import annotations

from typing import Any

from asyncllm.errors import NotBuiltError
from asyncllm.models.llama import DecoderBuild, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncllm.models.moe import MoECausalLM, MoESpec, num_experts_of
from asyncllm.models.olmo2 import Olmo2Attention, Olmo2ForCausalLM

__all__ = ["FlexOlmoForCausalLM", "OlmoeForCausalLM"]


class OlmoeAttention(Olmo2Attention):
    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.q_norm.weight_after_rounding = self.k_norm.weight_after_rounding = True


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention


class OlmoeModel(LlamaModel):
    layer_cls = OlmoeDecoderLayer


class OlmoeForCausalLM(MoECausalLM, LlamaForCausalLM):
    """Llama's layers, whole-projection q/k norms, an MoE in every layer."""

    lora_experts = True

    model_cls = OlmoeModel

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        return MoESpec(num_experts_of(hf_config), hf_config.num_experts_per_tok, hf_config.intermediate_size,
                       renormalize=bool(hf_config.norm_topk_prob), weights_in_model_dtype=True)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "clip_qkv", None) is not None:
            raise NotBuiltError("clip_qkv", hf_config.clip_qkv, "OLMoE with q, k and v clipped")
        super().__init__(hf_config, **kwargs)


class FlexOlmoForCausalLM(MoECausalLM, Olmo2ForCausalLM):
    """OLMo 2's layers with OLMoE's experts in every layer."""

    lora_experts = True
    moe_spec = OlmoeForCausalLM.moe_spec
