"""AI21 Jamba (``JambaForCausalLM``: Jamba-v0.1, Jamba 1.5 / 1.6 / 1.7 Mini and Large, Jamba Reasoning 3B):
by ``layers_block_type`` a Mamba (v1) mixer (asyncllm/models/mamba1.py) or attention without positions (the
identity rotary), each followed by a SwiGLU MLP or, by ``layers_num_experts``, Mixtral-style experts (the softmax's
top k, not renormalized, rounded to the model dtype); on the hybrid stack of asyncllm/models/hybrid.py. Checkpoint
names map to Llama's at load (``feed_forward`` -> ``mlp``, ``router`` -> ``gate``, ``pre_ff_layernorm`` ->
``post_attention_layernorm``, ``final_layernorm`` -> ``norm``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.models.hybrid import HybridBuild, HybridLayer, HybridModel, StateLayersMixin, renamed
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel, head_dim_of
from asyncllm.models.llama import DecoderBuild, LlamaAttention, LlamaForCausalLM, LlamaMLP
from asyncllm.models.mamba1 import Mamba1Mixer
from asyncllm.models.moe import MoECausalLM, MoESpec, SparseMoeBlock
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.rotary import identity_rotary

__all__ = ["JambaForCausalLM"]

_NAMES = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."),
          (".pre_ff_layernorm.", ".post_attention_layernorm."), ("model.final_layernorm.", "model.norm."))


class JambaLayer(HybridLayer):
    state_name = "mamba"

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        cfg = b.hf_config
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)  # noqa: E731
        super().__init__(b, layer_idx, norm, lambda: Mamba1Mixer(cfg, b.dtype, b.state_rows, b.attn_backend.ops),
                         lambda: LlamaAttention(b, layer_idx))


class JambaModel(HybridModel):
    layer_cls = JambaLayer


class JambaForCausalLM(StateLayersMixin, MoECausalLM, LlamaForCausalLM):
    model_cls = JambaModel

    @staticmethod
    def kv_cache_layers(hf_config: Any) -> int:
        return sum(1 for kind in hf_config.layers_block_type if kind == "attention")

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if hf_config.layers_num_experts[layer_idx] <= 1:
            return None
        return MoESpec(hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size,
                       renormalize=False, weights_in_model_dtype=True)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        spec = cls.moe_spec(b.hf_config, layer_idx)
        return LlamaMLP(b) if spec is None else SparseMoeBlock(spec, b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Jamba")  # its layer_types ("linear_attention" / "full_attention") drive the stack
        super().__init__(hf_config, **kwargs)

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> HybridBuild:
        """The hybrid build, its attention turning nothing (Jamba's attention uses no positions)."""
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        return dataclasses.replace(build, rotary_emb=identity_rotary(hf_config, head_dim_of(hf_config), max_position))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((renamed(name, _NAMES), w) for name, w in weights)
