"""Microsoft Phi-3.5-MoE (Phi-3.5-MoE-instruct): ``PhimoeForCausalLM``.

Mixtral's layers and checkpoint names (asyncllm/models/mixtral.py) with Phi's differences:

- routing by SparseMixer as transformers runs it at inference (`sparsemixer`): the first expert is the logits'
  argmax, weighted by the softmax over the experts whose logit is within ``2 * router_jitter_noise`` (relative)
  of it; the second the argmax of the rest, weighted the same way among the rest;
- LayerNorms with biases (``rms_norm_eps``), q/k/v/o biases (``attention_bias``), an LM-head bias
  (``lm_head_bias``);
- a LongRoPE rope scales its cos and sin by ``short_mscale`` or ``long_mscale``: the factor set and the scale are
  fixed for the model by ``max_model_len`` as Phi-3's (docs/phi3.md#longrope-which-factors).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.models.layers import LoadedWeight, head_dim_of
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaModel
from asyncllm.models.mixtral import MixtralForCausalLM
from asyncllm.models.moe import MoESpec, SparseMoeBlock
from asyncllm.models.phi import renamed
from asyncllm.models.rope_config import longrope_original
from asyncllm.models.rotary import RotaryEmbedding, fix_longrope_factors, rope_parameters
from asyncllm.models.starcoder2 import BiasLayerNorm, Starcoder2DecoderLayer

__all__ = ["PhimoeForCausalLM", "sparsemixer"]


def _masked_choice(scores: torch.Tensor, threshold: torch.Tensor, jitter: float) -> torch.Tensor:
    """``scores`` with the experts whose logit is more than ``2 * jitter`` (relative) below ``threshold`` masked."""
    factor = scores.abs().clamp(min=threshold)
    return scores.masked_fill((threshold - scores) / factor > 2 * jitter, float("-inf"))


def sparsemixer(logits: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` router logits -> (weights ``[T, 2]`` float32, ids ``[T, 2]``): transformers' inference-time
    SparseMixer, its softmax in the logits' dtype."""
    top, first = logits.max(dim=-1, keepdim=True)
    weight_1 = torch.softmax(_masked_choice(logits, top, jitter), dim=-1).gather(-1, first)
    rest = logits.scatter(-1, first, float("-inf"))
    top_2, second = rest.max(dim=-1, keepdim=True)
    weight_2 = torch.softmax(_masked_choice(rest, top_2, jitter), dim=-1).gather(-1, second)
    return torch.cat([weight_1, weight_2], dim=-1).float(), torch.cat([first, second], dim=-1)


class PhimoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__(spec, b)
        self.jitter = float(b.hf_config.router_jitter_noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sparsemixer(self.gate(x), self.jitter)
        return self.experts(x, weights, ids)


class PhimoeModel(LlamaModel):
    layer_cls = Starcoder2DecoderLayer
    norm_cls = BiasLayerNorm


class PhimoeForCausalLM(MixtralForCausalLM):
    """Mixtral's layers with SparseMixer routing, LayerNorms, biases and Phi's LongRoPE scale."""

    model_cls = PhimoeModel
    takes_max_model_len = True
    """The loader passes ``max_model_len``: it chooses LongRoPE's factors and scale."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return PhimoeSparseMoeBlock(cls.moe_spec(b.hf_config, layer_idx), b)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: Any, attn_backend: Any, max_position: int,
                      expert_parallel: bool) -> DecoderBuild:
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        params = rope_parameters(hf_config)
        if params.get("rope_type", "default") == "default":
            return build
        return dataclasses.replace(build, rotary_emb=_mscaled_rotary(hf_config, params, max_position))

    def __init__(self, hf_config: Any, *, max_position: int, max_model_len: int | None = None, **kwargs: Any) -> None:
        from asyncllm.errors import NotBuiltError

        if hf_config.num_experts_per_tok != 2:
            raise NotBuiltError("num_experts_per_tok", hf_config.num_experts_per_tok, "Phi-3.5-MoE's top 2")
        config = fix_longrope_factors(copy.copy(hf_config), max_model_len or max_position)
        config.phimoe_long = (max_model_len or max_position) > _original_length(hf_config)
        super().__init__(config, max_position=max_position, **kwargs)

    @classmethod
    def has_lm_head_bias(cls, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "lm_head_bias", False))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The router under transformers 5's name too (its modules' ``mlp.router``), as the checkpoint's
        ``block_sparse_moe.gate``."""
        return super().load_weights(renamed(weights, ((".mlp.router.weight", ".block_sparse_moe.gate.weight"),)))


def _original_length(hf_config: Any) -> int:
    return longrope_original(hf_config) or int(hf_config.max_position_embeddings)


def _mscaled_rotary(hf_config: Any, params: dict[str, Any], max_position: int) -> RotaryEmbedding:
    """The rope with transformers' Phimoe scale: ``long_mscale`` past the original length, else ``short_mscale``."""
    scale = params["long_mscale"] if getattr(hf_config, "phimoe_long", False) else params["short_mscale"]
    return RotaryEmbedding(hf_config, head_dim_of(hf_config), max_position, scaling=float(scale))
