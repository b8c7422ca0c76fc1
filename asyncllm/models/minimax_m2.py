"""MiniMax-M2 / M2.1 (``MiniMaxM2ForCausalLM``): OLMoE's layers (Llama's pre-norm layers with q and k RMS-normed over
the whole projection, Llama's rounding: asyncllm/models/olmoe.py) with a partial rotary (``rotary_dim`` of each
head) and a mixture of experts in every layer, named as Mixtral's (``block_sparse_moe``, experts ``w1`` / ``w3`` /
``w2``) and routed as DeepSeek-V3's without groups: sigmoid scores of the model-dtype router, the top k chosen by
score plus the block's ``e_score_correction_bias``, weighted by their renormalized scores."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models.layers import new_param
from asyncllm.models.llama import DecoderBuild, LlamaForCausalLM
from asyncllm.models.mixtral import MixtralForCausalLM
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec, num_experts_of, select_experts_by_scores
from asyncllm.models.olmoe import OlmoeModel

__all__ = ["MiniMaxM2ForCausalLM"]


class _Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(num_experts, hidden, dtype=dtype)


class MiniMaxM2MoE(nn.Module):
    """Sigmoid routing with a score correction, the chosen scores renormalized; no shared expert."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.gate = _Router(spec.num_experts, b.hf_config.hidden_size, b.dtype)
        self.e_score_correction_bias = new_param(spec.num_experts, dtype=torch.float32)
        self.experts = FusedMoE(spec, b.hf_config.hidden_size, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.linear(x, self.gate.weight).float().sigmoid()
        weights, ids = select_experts_by_scores(scores, self.top_k, renormalize=True, bias=self.e_score_correction_bias)
        return self.experts(x, weights, ids)


class MiniMaxM2ForCausalLM(MoECausalLM, LlamaForCausalLM):
    lora_experts = True
    model_cls = OlmoeModel
    moe_module = MixtralForCausalLM.moe_module
    expert_parts = MixtralForCausalLM.expert_parts

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        return MoESpec(num_experts_of(hf_config), hf_config.num_experts_per_tok, hf_config.intermediate_size,
                       renormalize=True, weights_in_model_dtype=False)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return MiniMaxM2MoE(cls.moe_spec(b.hf_config, layer_idx), b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
