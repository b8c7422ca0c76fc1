"""Meta Llama 4 text (``Llama4ForCausalLM``; the language model of ``Llama4ForConditionalGeneration`` checkpoints,
Llama-4-Scout-17B-16E / Maverick-17B-128E, served as text: their vision model is not read).

- Attention: rotary layers (``no_rope_layers[i]`` = 1) rotate interleaved pairs (de-interleaved before the backends'
  half-split rotation, which turns the same pairs: q . k is unchanged), L2-norm q and k without weights
  (``use_qk_norm``; rotations keep the norm, so it runs before the rotation here), and attend within chunks of
  ``attention_chunk_size`` positions (``layer_types`` "chunked_attention"); the other layers use no positions and
  scale q by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` (``attn_temperature_tuning``).
- MLPs: dense (``intermediate_size_mlp``) or, in ``moe_layers``, one routed expert of ``num_local_experts``
  chosen by the router's largest logit, its input scaled by that logit's sigmoid, plus a shared expert. The
  checkpoints' experts are fused (``experts.gate_up_proj`` ``[E, hidden, 2I]``, ``down_proj``) and cut per
  expert at load; ``feed_forward`` is read as ``mlp``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.errors import NotBuiltError
from asyncllm.models.deepseek import pairs_to_halves
from asyncllm.models.layers import Attention, LoadedWeight, TensorParallel
from asyncllm.models.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncllm.models.llama import (
    DecoderBuild, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, with_rope_only_in,
)
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.qwen3_vl_moe import split_fused_experts
from asyncllm.models.vision_language import text_only_class

__all__ = ["Llama4ForCausalLM", "Llama4TextOnly"]


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Llama4TextL2Norm``: RMS-normed in float32, no weight."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(nn.Module):
    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        head_dim, bias = cfg.head_dim, bool(cfg.attention_bias)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias, b.tp, b.dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size, bias, b.tp, b.dtype)
        self.use_rope = bool(cfg.no_rope_layers[layer_idx])
        self.qk_norm = bool(cfg.use_qk_norm) and self.use_rope
        self.eps = cfg.rms_norm_eps
        self.temperature = (bool(cfg.attn_temperature_tuning) and not self.use_rope,
                            float(cfg.floor_scale), float(cfg.attn_scale))
        self.rotary_emb = b.layer_rotary[layer_idx] if b.layer_rotary is not None else b.rotary_emb
        chunked = cfg.layer_types[layer_idx] == "chunked_attention"
        qkv = self.qkv_proj
        self.attn = Attention(qkv.num_heads, qkv.num_kv_heads, head_dim, b.attn_backend,
                              attention_chunk_size=cfg.attention_chunk_size if chunked else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        query, key, value = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        if self.use_rope:
            query, key = pairs_to_halves(query), pairs_to_halves(key)
        if self.qk_norm:
            query, key = _l2_norm(query, self.eps), _l2_norm(key, self.eps)
        tuned, floor_scale, attn_scale = self.temperature
        if tuned:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            query = (query * scales[:, None, None]).to(query.dtype)
        rotary = RotaryInputs(positions, self.rotary_emb.cos_sin_cache)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata, rotary))


class Llama4MoE(nn.Module):
    """The top-1 expert on its input scaled by the sigmoid of the router's logit, plus the shared expert."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        self.router = ColumnParallelLinear(cfg.hidden_size, spec.num_experts, False, TensorParallel(), b.dtype)
        self.experts = FusedMoE(spec, cfg.hidden_size, b)
        self.shared_expert = LlamaMLP(b, spec.shared_expert_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = self.router(x).topk(1, dim=-1)
        scaled = x * torch.sigmoid(top.float()).to(x.dtype)
        routed = self.experts(scaled, torch.ones_like(top, dtype=torch.float32), ids)
        return self.shared_expert(x) + routed


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Llama4Attention  # type: ignore[assignment]

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.fused_decode_rows = 0  # the fused decode products read a plain attention's projections


class Llama4Model(LlamaModel):
    layer_cls = Llama4DecoderLayer


class Llama4ForCausalLM(MoECausalLM, LlamaForCausalLM):
    model_cls = Llama4Model
    lora_experts = True  # its adapters' feed_forward.* read as mlp.* (asyncllm/lora_experts.py)
    lora_experts_transposed = True
    """PEFT stores its stacked experts' adapters with A and B each in the other's place (``[E, in, out]``)."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if layer_idx not in hf_config.moe_layers:
            return None
        return MoESpec(hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size,
                       renormalize=False, weights_in_model_dtype=False,
                       shared_expert_size=hf_config.intermediate_size)  # `Llama4MoE`'s shared expert

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        spec = cls.moe_spec(b.hf_config, layer_idx)
        return LlamaMLP(b, b.hf_config.intermediate_size_mlp) if spec is None else Llama4MoE(spec, b)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        """Llama's build, the layers without positions turning by the identity table."""
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        return with_rope_only_in(build, [bool(r) for r in hf_config.no_rope_layers], max_position)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Llama 4")
        if hf_config.num_experts_per_tok != 1:
            raise NotBuiltError("num_experts_per_tok", hf_config.num_experts_per_tok,
                                "Llama 4 with one routed expert per token (its input is scaled by the expert's score)")
        super().__init__(hf_config, **kwargs)
        self.expert_sizes = (int(hf_config.hidden_size), int(hf_config.intermediate_size))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        renamed = ((name.replace(".feed_forward.", ".mlp."), w) for name, w in weights)
        return super().load_weights(split_fused_experts(renamed, *self.expert_sizes))


Llama4TextOnly = text_only_class(Llama4ForCausalLM, ("vision_model.", "multi_modal_projector."))
"""A ``Llama4ForConditionalGeneration`` checkpoint's language model, for text prompts (the vision model and its
projector are not read)."""
