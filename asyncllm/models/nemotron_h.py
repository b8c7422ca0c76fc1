"""NVIDIA Nemotron-H (``NemotronHForCausalLM``: Nemotron-H 4B / 8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B / 12B-v2):
a stack of single-mixer layers by ``layers_block_type`` (the older ``hybrid_override_pattern``): Mamba2
(asyncllm/models/mamba2.py: ``mamba_num_heads x mamba_head_dim`` wide, ``dt`` clamped to ``time_step_limit`` in
prefill chunks as vLLM and transformers >= 5.25 do: ``time_step_min`` only bounds ``dt_bias``'s initialization),
attention without positions (Llama's projections, the identity rotary: exact), or a squared-ReLU MLP (``up_proj``,
``down_proj``); each after one RMSNorm (``norm``), its output added to the residual stream. The checkpoints'
``backbone.`` prefix, ``embeddings`` and ``norm_f`` are read as Llama's names. Nemotron 3's mixture-of-experts
layers ("moe"): DeepSeek-V3's grouped sigmoid router (asyncllm/models/deepseek_moe.py), experts without a gate
(``relu(up x) ** 2``, the fused-MoE kernel's ``relu2``) on the hidden state or on its projection to
``moe_latent_size`` (``fc1_latent_proj`` / ``fc2_latent_proj``, kept whole on every rank), plus the shared
squared-ReLU MLP.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import NotBuiltError
from asyncllm.models.deepseek_moe import DeepseekRouter
from asyncllm.models.ernie_seed_arcee import ArceeMLP
from asyncllm.models.hybrid import HybridBuild, HybridModel, StateLayersMixin
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel, head_dim_of
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.llama import LlamaAttention, LlamaForCausalLM
from asyncllm.models.mamba2 import Mamba2Mixer, Mamba2Shape
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.rotary import identity_rotary

__all__ = ["NemotronHForCausalLM", "nemotron_mamba"]

_MIXERS = ("linear_attention", "full_attention", "mlp", "moe")


def nemotron_mamba(cfg: Any) -> Mamba2Shape:
    """Nemotron-H's names for a Mamba2 layer's sizes."""
    return Mamba2Shape(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size,
                       cfg.conv_kernel, bool(cfg.use_conv_bias), bool(cfg.use_bias), cfg.layer_norm_epsilon,
                       tuple(getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))))


def nemotron_moe_spec(cfg: Any) -> MoESpec:
    return MoESpec(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   renormalize=bool(cfg.norm_topk_prob), weights_in_model_dtype=False,
                   shared_expert_size=cfg.moe_shared_expert_intermediate_size, activation="relu2")


class NemotronHMoE(nn.Module):
    """Routed experts without a gate (on the latent projection when there is one) plus the shared MLP."""

    def __init__(self, b: HybridBuild) -> None:
        super().__init__()
        cfg, spec = b.hf_config, nemotron_moe_spec(b.hf_config)
        latent, whole = cfg.moe_latent_size, TensorParallel()
        self.gate = DeepseekRouter(cfg, spec)
        self.experts = FusedMoE(spec, latent or cfg.hidden_size, b)
        self.shared_experts = ArceeMLP(b, spec.shared_expert_size)
        self.latent = latent is not None
        if self.latent:
            self.fc1_latent_proj = ColumnParallelLinear(cfg.hidden_size, latent, b.flags.mlp_bias, whole, b.dtype)
            self.fc2_latent_proj = ColumnParallelLinear(latent, cfg.hidden_size, b.flags.mlp_bias, whole, b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = self.experts(self.fc1_latent_proj(x) if self.latent else x, weights, ids)
        return (self.fc2_latent_proj(routed) if self.latent else routed) + self.shared_experts(x)


class NemotronHLayer(nn.Module):
    """One RMSNorm, then one mixer: Mamba2, attention, the MLP or the experts."""

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        self.kind = cfg.layer_types[layer_idx]
        if self.kind not in _MIXERS:
            raise NotBuiltError("layers_block_type", self.kind, f"Nemotron-H layers of the types {', '.join(_MIXERS)}")
        self.is_linear = self.kind == "linear_attention"
        self.uses_kv_cache = self.kind == "full_attention"
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        if self.is_linear:
            self.mixer: nn.Module = Mamba2Mixer(nemotron_mamba(cfg), b.dtype, b.state_rows, b.attn_backend.ops)
        elif self.uses_kv_cache:
            self.mixer = LlamaAttention(b, layer_idx)
        elif self.kind == "moe":
            self.mixer = NemotronHMoE(b)
        else:
            self.mixer = ArceeMLP(b)  # the squared-ReLU MLP

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = (self.norm(hidden), hidden) if residual is None else self.norm(hidden, residual)
        if self.kind in ("mlp", "moe"):
            return self.mixer(hidden), residual
        return self.mixer(positions, hidden, kv_cache, metadata), residual


class NemotronHModel(HybridModel):
    layer_cls = NemotronHLayer


class NemotronHForCausalLM(StateLayersMixin, MoECausalLM, LlamaForCausalLM):
    model_cls = NemotronHModel
    packed_modules = {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]}
    """Only the attention's q/k/v are fused (the MLP's ``up_proj`` stays as it is)."""

    expert_parts = {"up_proj": "up", "down_proj": "down"}

    @staticmethod
    def kv_cache_layers(hf_config: Any) -> int:
        return sum(1 for kind in hf_config.layer_types if kind == "full_attention")

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        return nemotron_moe_spec(hf_config) if hf_config.layer_types[layer_idx] == "moe" else None

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Nemotron-H")
        config = copy.copy(hf_config)  # Llama's names for Nemotron-H's fields
        config.rms_norm_eps = hf_config.layer_norm_epsilon
        config.num_hidden_layers = len(hf_config.layer_types)
        config.hidden_act = hf_config.mlp_hidden_act  # the MLP layers' (ArceeMLP checks it is relu2)
        super().__init__(config, **kwargs)

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> HybridBuild:
        """The hybrid build, its attention turning nothing (Nemotron-H's attention uses no positions)."""
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        return dataclasses.replace(build, rotary_emb=identity_rotary(hf_config, head_dim_of(hf_config), max_position))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((llama_name(name), w) for name, w in weights)

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        """Llama's, an adapter's ``self_attn.`` / ``mlp.`` names (asyncllm/lora_names.py) read as
        this model's ``mixer.``."""
        return super()._packed(ckpt_name.replace(".self_attn.", ".mixer.").replace(".mlp.", ".mixer."))


def llama_name(name: str) -> str:
    """A Nemotron-H checkpoint name as the modules here name it."""
    name = "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name
    return name.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")
