"""Arcee AFMoE (``AfmoeForCausalLM``: Trinity-Nano, Trinity-Mini, Trinity-Large), in transformers' order of operations:

- **Attention.** Llama's q/k/v/o projections (biased when ``attention_bias``), an RMSNorm on each query and key head,
  and an output gate: the heads' values times ``sigmoid(gate_proj(x))`` (its own projection, one row per value
  element) before ``o_proj``. The layers of ``layer_types`` alternate: ``sliding_attention`` ones attend within
  ``sliding_window`` and rotate q and k (the config's one rope); ``full_attention`` ones attend to everything with
  no positions at all (an identity rotary, exact: `with_rope_only_in`).
- **Four norms per layer** (Gemma 2's places): before and after attention, before and after the MLP, each
  sublayer's output normed before it joins the residual stream. Every norm (the q/k ones and the final one too)
  multiplies its weight in float32 and rounds once (transformers keeps them float32: OLMo 2's `Olmo2RMSNorm`).
- **Embeddings** times ``sqrt(hidden_size)`` when ``mup_enabled`` (given prompt embeddings too, as transformers).
- **Experts.** The first ``num_dense_layers`` layers have a dense SiLU MLP; the others a router (``router.gate``,
  in the model's dtype) whose sigmoid scores plus the block's float32 ``expert_bias`` choose the top
  ``num_experts_per_tok`` of ``num_experts``, weighted by their plain scores renormalized (``+ 1e-20``) and times
  ``route_scale``, plus ``num_shared_experts`` shared experts (one MLP as wide as that many experts) every token
  runs. Checkpoints name each expert's matrices (``experts.{e}.gate_proj``...) or stack them (transformers 5's
  ``experts.gate_up_proj`` / ``down_proj``): both load (asyncllm/models/moe.py).

Routing settings transformers' model does not run (``score_func`` other than sigmoid, ``route_norm`` off, grouped
top-k with ``topk_group < n_group``) are a `NotBuiltError`, as is another MLP activation than SiLU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import TensorParallel, head_dim_of, new_param, norm_in
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.llama import (
    DecoderBuild, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, check_silu, with_rope_only_in,
)
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec, ReplicatedLinear, select_experts_by_scores
from asyncllm.models.olmo2 import Olmo2RMSNorm

__all__ = ["AfmoeForCausalLM", "check_afmoe"]


def check_afmoe(hf_config: Any) -> None:
    """`NotBuiltError` for the settings transformers' AFMoE does not run: it routes by sigmoid scores, always
    renormalized, over all experts (no groups), through SiLU MLPs."""
    check_silu(hf_config)
    score_func = getattr(hf_config, "score_func", None) or "sigmoid"
    if score_func != "sigmoid":
        raise NotBuiltError("score_func", score_func, "AFMoE routing by sigmoid scores (transformers' only)")
    if getattr(hf_config, "route_norm", True) is False:
        raise NotBuiltError("route_norm", False, "AFMoE routing weights renormalized (transformers always does)")
    groups, topk_group = getattr(hf_config, "n_group", None) or 1, getattr(hf_config, "topk_group", None) or 1
    if topk_group < groups:
        raise NotBuiltError("topk_group", topk_group, f"AFMoE routing over every expert group (topk_group = "
                                                      f"n_group = {groups}: transformers ignores groups)")


class AfmoeAttention(LlamaAttention):
    """Llama's attention with per-head q/k norms (in torch: transformers' float32 weight) and the output gate."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)  # b.flags.qk_norm is False: the backend's fused norm stays off
        cfg = b.hf_config
        head_dim = head_dim_of(cfg)
        self.q_norm = Olmo2RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype)
        self.k_norm = Olmo2RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype)
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_attention_heads * head_dim, False, b.tp,
                                              b.dtype)  # this rank's heads' rows, as q's

    def norm_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(query), self.k_norm(key)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        values = self.attention_values(positions, self.qkv_proj(hidden), kv_cache, metadata)
        return self.o_proj(values * torch.sigmoid(self.gate_proj(hidden)))


class AfmoeMoE(nn.Module):
    """Sigmoid scores chosen with the expert bias, weighted renormalized times ``route_scale``; shared experts."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        self.spec, self.route_scale = spec, float(cfg.route_scale)
        self.router = nn.Module()
        self.router.gate = ReplicatedLinear(spec.num_experts, cfg.hidden_size, b.dtype)
        self.expert_bias = new_param(spec.num_experts, dtype=torch.float32)
        self.experts = FusedMoE(spec, cfg.hidden_size, b)
        self.shared_experts = LlamaMLP(b, spec.shared_expert_size) if spec.shared_expert_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router.gate(x).float().sigmoid()
        weights, ids = select_experts_by_scores(scores, self.spec.top_k, renormalize=self.spec.renormalize,
                                                scaling=self.route_scale, bias=self.expert_bias, ordered=True)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class AfmoeDecoderLayer(nn.Module):
    """Norms before and after each sublayer; the gated attention, then the dense MLP or the experts."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config

        def norm() -> Olmo2RMSNorm:
            return Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.self_attn = AfmoeAttention(b, layer_idx)
        self.pre_mlp_layernorm, self.post_mlp_layernorm = norm(), norm()
        self.mlp = b.make_mlp(b, layer_idx)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it), as `LlamaDecoderLayer`."""
        hidden, residual = norm_in(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, metadata))
        hidden, residual = self.pre_mlp_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class AfmoeModel(LlamaModel):
    layer_cls = AfmoeDecoderLayer
    norm_cls = Olmo2RMSNorm

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        cfg = b.hf_config
        self.embed_scale = cfg.hidden_size**0.5 if getattr(cfg, "mup_enabled", False) else None
        """muP's input scale (a Python float, as transformers multiplies by it); None: off."""

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = super().embed(input_ids, positions, inputs_embeds)
        return hidden if self.embed_scale is None else hidden * self.embed_scale


class AfmoeForCausalLM(MoECausalLM, LlamaForCausalLM):
    """AFMoE's layers (see the module doc)."""

    model_cls = AfmoeModel
    lora_experts = True

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if layer_idx < (hf_config.num_dense_layers or 0):
            return None
        size = hf_config.moe_intermediate_size
        return MoESpec(hf_config.num_experts, hf_config.num_experts_per_tok, size, renormalize=True,
                       weights_in_model_dtype=False, shared_expert_size=size * (hf_config.num_shared_experts or 0))

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        spec = cls.moe_spec(b.hf_config, layer_idx)
        return LlamaMLP(b) if spec is None else AfmoeMoE(spec, b)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        """Llama's build, rotating only the sliding-window layers."""
        check_afmoe(hf_config)
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        return with_rope_only_in(build, (kind == "sliding_attention" for kind in hf_config.layer_types), max_position)

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        """The attention's own ``gate_proj`` loads as named (the MLPs' ``gate_proj`` is fused into ``gate_up_proj``)."""
        if ".self_attn.gate_proj." in ckpt_name:
            return ckpt_name, None
        return super()._packed(ckpt_name)
