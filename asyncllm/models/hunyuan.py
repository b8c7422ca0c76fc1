"""Tencent Hunyuan dense (Hunyuan-0.5B / 1.8B / 4B / 7B, pretrain and instruct): ``HunYuanDenseV1ForCausalLM``; and
Hunyuan-A13B (``HunYuanMoEV1ForCausalLM``): the same layers with a mixture of experts (a float32 router ``wg``, the
top ``moe_topk`` of its softmax renormalized) plus a shared MLP every token runs.

The Llama decoder (asyncllm/models/llama.py) with two differences:

- q and k are normed per head *after* the rotary (``query_layernorm``, ``key_layernorm``), where the backends'
  fused norm-and-rotate norms before it: this attention rotates q and k itself (the torch reference rotation,
  as transformers does it), norms them, and hands the backend an identity table (`with_rope_only_in`), so the
  backends' kernels, KV cache and CUDA graphs run unchanged;
- the rope: the checkpoints' ``{"rope_type": "dynamic", "alpha": a}`` is NTK scaling with a fixed alpha, base
  ``rope_theta * a ** (head_dim / (head_dim - 2))``, so it does not depend on the sequence length (transformers
  calls it ``ntk_alpha``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.attention.selector import AttentionBackend
from asyncllm.models.layers import RMSNorm, TensorParallel, head_dim_of
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.llama import (
    DecoderBuild,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    with_rope_only_in,
)
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec, select_experts
from asyncllm.models.rotary import rope_parameters

__all__ = ["HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM", "ntk_alpha_config"]


def ntk_alpha_config(hf_config: Any) -> Any:
    """``hf_config`` with a fixed-alpha "dynamic" rope as the plain rope of its stretched base (a copy); others as
    they are."""
    params = rope_parameters(hf_config)
    if params.get("rope_type") != "dynamic" or not params.get("alpha"):
        return hf_config
    dim = head_dim_of(hf_config)
    fixed = copy.copy(hf_config)
    fixed.rope_parameters = {"rope_type": "default",
                             "rope_theta": params["rope_theta"] * params["alpha"] ** (dim / (dim - 2))}
    return fixed


class HunYuanAttention(LlamaAttention):
    """Rotate q and k here (the model's rope), norm each head, then the backend with the identity table."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg, head_dim = b.hf_config, head_dim_of(b.hf_config)
        self.rope = b.rotary_emb
        self.query_layernorm = RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype)
        self.key_layernorm = RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        query, key, value = self.qkv_proj.split_qkv(qkv)
        query, key = self.rope(positions, query, key)  # the torch reference rotation (HunYuan VL's: XD-RoPE)
        query, key = self.query_layernorm(query), self.key_layernorm(key)
        rotary = RotaryInputs(positions, self.rotary_emb.cos_sin_cache)  # the identity: already turned
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata, rotary))


class HunYuanDecoderLayer(LlamaDecoderLayer):
    attention_cls = HunYuanAttention


class HunYuanModel(LlamaModel):
    layer_cls = HunYuanDecoderLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """Llama's layers; q and k normed per head after the rotary; the fixed-alpha NTK rope."""

    model_cls = HunYuanModel

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        rope_config = ntk_alpha_config(hf_config)
        build = super().decoder_build(rope_config, dtype, tp, attn_backend, max_position, expert_parallel)
        build = with_rope_only_in(build, [False] * hf_config.num_hidden_layers, max_position)
        return dataclasses.replace(build, hf_config=hf_config)


class _Gate(nn.Module):
    """The router, its float32 matrix under transformers' name ``wg``."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.wg = ColumnParallelLinear(hidden, num_experts, False, TensorParallel(), torch.float32)


class HunYuanMoE(nn.Module):
    """The top k of a float32 softmax, renormalized, over the experts; plus the shared MLP every token runs."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.gate = _Gate(spec.num_experts, b.hf_config.hidden_size)
        self.experts = FusedMoE(spec, b.hf_config.hidden_size, b)
        self.shared_mlp = LlamaMLP(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate.wg(x.float()), self.top_k, renormalize=True)
        return self.experts(x, weights, ids) + self.shared_mlp(x)


class HunYuanMoEV1ForCausalLM(MoECausalLM, HunYuanDenseV1ForCausalLM):
    """Hunyuan-A13B: the dense model's layers with `HunYuanMoE` MLPs."""

    lora_experts = True

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        def per_layer(value: Any) -> int:
            return int(value if isinstance(value, int) else value[layer_idx])

        return MoESpec(per_layer(hf_config.num_experts), per_layer(hf_config.moe_topk), hf_config.intermediate_size,
                       renormalize=True, weights_in_model_dtype=False)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return HunYuanMoE(cls.moe_spec(b.hf_config, layer_idx), b)
