"""IBM Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``: granite-4.0-h-micro / h-tiny / h-small, and the dense
granite-4.0-micro): Mamba2 layers (asyncllm/models/mamba2.py) and attention layers by ``layer_types``, Granite's
four multipliers (asyncllm/models/granite.py), and after each mixer a shared MLP (``shared_mlp``, its gate and up
rows stored fused as ``input_linear``) plus, when the model has experts, Granite MoE's experts
(asyncllm/models/granitemoe.py) added to it. The attention layers rotate q and k only with
``position_embedding_type="rope"``; the released hybrids use no positions there (the identity rotary: exact)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.granite import GraniteEmbedding
from asyncllm.models.granitemoe import GraniteMoeForCausalLM, shared_mlp_parts
from asyncllm.models.bamba import BambaLayer
from asyncllm.models.hybrid import HybridBuild, HybridModel, StateLayersMixin
from asyncllm.models.layers import LoadedWeight, TensorParallel, head_dim_of
from asyncllm.models.llama import DecoderBuild, LlamaMLP
from asyncllm.models.moe import MoESpec, num_experts_of
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.rotary import RotaryEmbedding, identity_rotary

__all__ = ["GraniteMoeHybridForCausalLM"]


class Granite4Layer(BambaLayer):
    """Bamba's layer (pre-norm Mamba2 or attention) with the shared MLP (plus the experts) after it; each output
    times ``residual_multiplier`` before it joins the residual stream."""

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.shared_mlp = LlamaMLP(b, cfg.shared_intermediate_size)
        self.residual_multiplier = self.mixer_residual_scale = b.flags.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.post_attention_layernorm(*self.mix(positions, hidden, residual, kv_cache, metadata))
        out = self.shared_mlp(hidden)
        if self.mlp is not None:
            out = self.mlp(hidden) + out
        return out * self.residual_multiplier, residual


class Granite4Model(HybridModel):
    embedding_cls = GraniteEmbedding
    layer_cls = Granite4Layer

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        self.embed_tokens.multiplier = float(b.hf_config.embedding_multiplier)


class GraniteMoeHybridForCausalLM(StateLayersMixin, GraniteMoeForCausalLM):
    """Granite 4.0: Granite MoE's multipliers, experts and their loading, over Mamba2 / attention layers."""

    model_cls = Granite4Model

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if not num_experts_of(hf_config):
            return None
        return super().moe_spec(hf_config, layer_idx)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module | None:
        """The experts (or None: a dense Granite 4.0 runs its shared MLP alone)."""
        return super().make_mlp(b, layer_idx) if cls.moe_spec(b.hf_config, layer_idx) else None

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> HybridBuild:
        """The hybrid build with the attention layers' rotary: the config's rope, or none."""
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        head_dim = head_dim_of(hf_config)
        rope = (RotaryEmbedding(hf_config, head_dim, max_position) if hf_config.position_embedding_type == "rope"
                else identity_rotary(hf_config, head_dim, max_position))
        return dataclasses.replace(build, rotary_emb=rope)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Granite 4.0")
        super().__init__(hf_config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(shared_mlp_parts(weights))

