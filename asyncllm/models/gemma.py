"""The decoder Gemma 2 and Gemma 3 (text) share: the Llama decoder's projections, attention and weight
loading (asyncllm/models/llama.py, llama_weights.py) with Gemma's differences, each in transformers' order of operations:

- token embeddings times ``sqrt(hidden_size)``, that factor rounded to the model dtype first;
- RMSNorm with the weight stored as an offset from 1, computed in float32 and rounded once;
- four norms per layer: before and after attention, before and after the MLP;
- a GeGLU MLP, ``gelu_pytorch_tanh(gate) * up``;
- attention scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window or global per ``layer_types``,
  each layer type with its own rotary embedding when the config gives one per type (Gemma 3);
- ``final_logit_softcapping`` on the LM head's logits when set (``cap * tanh(logits / cap)``).

gemma2.py caps the attention scores too (``attn_logit_softcapping``); gemma3.py adds per-head q/k norms.
Gemma (1) (``Gemma1ForCausalLM``, transformers' ``GemmaForCausalLM``: gemma-2b / 7b, CodeGemma) is the same
decoder with two norms per layer (before attention and before the MLP, Llama's places), full attention in every
layer and the ``head_dim ** -0.5`` scale.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.models.embedding import VocabParallelEmbedding
from asyncllm.models.layers import Attention, RMSNorm, TensorParallel, head_dim_of, norm_in
from asyncllm.models.linear import MergedColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import (
    DecoderBuild, DecoderFlags, LlamaAttention, LlamaForCausalLM, LlamaModel, sliding_window_of,
)
from asyncllm.models.rotary import RotaryEmbedding, rope_parameters

__all__ = ["Gemma1ForCausalLM", "GemmaBuild", "GemmaForCausalLM", "GemmaMLP", "GemmaRMSNorm", "check_gemma",
           "rotary_by_layer_type"]


@dataclass(frozen=True)
class GemmaBuild(DecoderBuild):
    """`DecoderBuild` plus what Gemma's layers need."""

    rotary_by_layer_type: dict[str, RotaryEmbedding] = field(default_factory=dict)
    """Each ``layer_types`` entry's rotary embedding (one shared object where their parameters agree)."""
    attn_softcap: float | None = None
    """Attention scores become ``attn_softcap * tanh(score / attn_softcap)`` (Gemma 2); None: off."""
    qk_norm: bool = False
    """Gemma RMSNorm over each query and key head before the rotation (Gemma 3)."""


def check_gemma(hf_config: Any) -> None:
    """`NotBuiltError` for the Gemma variants not built: bidirectional attention, another MLP activation."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise NotBuiltError("model", True, "Gemma's use_bidirectional_attention (EmbeddingGemma)")
    if hf_config.hidden_activation != "gelu_pytorch_tanh":
        act = hf_config.hidden_activation
        raise NotBuiltError("model", act, f"the {act!r} MLP activation in Gemma (only 'gelu_pytorch_tanh')")


def rotary_by_layer_type(hf_config: Any, max_position: int) -> dict[str, RotaryEmbedding]:
    """A rotary embedding per layer type: Gemma 3's sliding layers rotate with ``rope_local_base_freq``
    (transformers 5: ``rope_parameters["sliding_attention"]``), its global ones with their own (scaled) rope."""
    head_dim = head_dim_of(hf_config)
    by_params: dict[str, RotaryEmbedding] = {}
    out = {}
    for layer_type in dict.fromkeys(hf_config.layer_types):
        key = repr(sorted(rope_parameters(hf_config, layer_type).items()))
        if key not in by_params:
            by_params[key] = RotaryEmbedding(hf_config, head_dim, max_position, layer_type)
        out[layer_type] = by_params[key]
    return out


class GemmaRMSNorm(RMSNorm):
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32, rounded once; ``forward(x, residual)``
    fuses the residual add before it, as `RMSNorm`."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.gemma_rms_norm(x, self.weight, self.eps)
        return self.ops.gemma_fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times ``sqrt(hidden_size)``, the factor rounded to the model dtype (as transformers)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__(vocab_size, hidden_size, tp, dtype)
        scale = torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale


class GemmaMLP(nn.Module):
    """``down(gelu_tanh(gate x) * up x)``, gate and up fused in one projection (``size`` wide; default
    ``intermediate_size``)."""

    def __init__(self, b: DecoderBuild, size: int | None = None) -> None:
        super().__init__()
        cfg = b.hf_config
        size = cfg.intermediate_size if size is None else size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], False, b.tp, b.dtype)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, b.tp, b.dtype)
        self.gelu_tanh_and_mul = b.attn_backend.ops.gelu_tanh_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale, score cap, per-layer-type rotary and (Gemma 3) q/k norms.

    The q/k norms run here rather than in the backend's fused rotary kernel, which rounds as Llama's
    RMSNorm does."""

    def __init__(self, b: GemmaBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)  # b.flags.qk_norm is False: no Llama-style q/k norms
        cfg = b.hf_config
        head_dim = head_dim_of(cfg)
        qkv = self.qkv_proj
        self.rotary_emb = b.rotary_by_layer_type[cfg.layer_types[layer_idx]]
        window = sliding_window_of(cfg, layer_idx)
        self.attn = Attention(qkv.num_heads, qkv.num_kv_heads, head_dim, b.attn_backend, window,
                              scale=cfg.query_pre_attn_scalar**-0.5, softcap=b.attn_softcap)
        self.gemma_qk_norm = b.qk_norm
        if b.qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
            self.k_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)

    def norm_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gemma_qk_norm:
            return self.q_norm(query), self.k_norm(key)
        return query, key


class GemmaDecoderLayer(nn.Module):
    def __init__(self, b: GemmaBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config

        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)

        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(b, layer_idx)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(b)
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it), as `LlamaDecoderLayer`: each
        sublayer's output is normed before it joins the residual stream."""
        hidden, residual = norm_in(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(LlamaModel):
    embedding_cls = GemmaScaledEmbedding
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm


class GemmaForCausalLM(LlamaForCausalLM):
    """The Gemma 2 / Gemma 3 causal LM; the families set the two class flags below."""

    model_cls = GemmaModel
    caps_attention = False
    """Whether ``attn_logit_softcapping`` applies (Gemma 2; transformers' Gemma 3 never passes it on)."""
    qk_norm = False
    """Whether each query and key head is normed before the rotation (Gemma 3)."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias)

    @classmethod
    def decoder_build(
        cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend, max_position: int,
        expert_parallel: bool,
    ) -> GemmaBuild:
        check_gemma(hf_config)
        ropes = rotary_by_layer_type(hf_config, max_position)
        softcap = hf_config.attn_logit_softcapping if cls.caps_attention else None
        return GemmaBuild(hf_config, cls.decoder_flags(hf_config), dtype, tp, attn_backend, next(iter(ropes.values())),
                          cls.make_mlp, expert_parallel, ropes, softcap, cls.qk_norm)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GemmaMLP(b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None) or None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits, capped (``final_logit_softcapping``) in the model dtype first,
        as transformers does."""
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma1DecoderLayer(nn.Module):
    """Gemma (1)'s layer: Llama's two pre-norms (Gemma's RMSNorm), Gemma's attention and GeGLU MLP."""

    def __init__(self, b: GemmaBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.self_attn = GemmaAttention(b, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.mlp = GemmaMLP(b)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = (self.input_layernorm(hidden), hidden) if residual is None else \
            self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, metadata),
                                                         residual)
        return self.mlp(hidden), residual


class Gemma1Model(GemmaModel):
    layer_cls = Gemma1DecoderLayer


class Gemma1ForCausalLM(GemmaForCausalLM):
    """Gemma (1): the Gemma decoder with Llama's two norms per layer, full attention, ``head_dim ** -0.5``."""

    model_cls = Gemma1Model

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        config = copy.copy(hf_config)  # Gemma 2's names for what Gemma (1) leaves implicit
        act = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
        config.hidden_activation = "gelu_pytorch_tanh" if act == "gelu" else act  # the releases' legacy "gelu"
        config.query_pre_attn_scalar = head_dim_of(hf_config)
        config.layer_types = ["full_attention"] * hf_config.num_hidden_layers
        config.sliding_window = None
        super().__init__(config, **kwargs)

