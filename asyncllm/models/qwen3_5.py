"""Qwen3.5 (``Qwen3_5ForCausalLM``; the text of ``Qwen3_5ForConditionalGeneration`` checkpoints in
language-model-only mode): a hybrid of Gated DeltaNet linear-attention layers (asyncllm/models/gated_deltanet.py)
and, every ``full_attention_interval``-th layer, gated full attention on the paged KV cache.

- Full attention: ``q_proj`` gives each head a query and an output gate (``[q, gate]`` per head: loaded as twice as
  many query heads, split after the projection); per-head q and k RMSNorms and every norm of the model are
  zero-centred (``1 + weight``, Gemma's: asyncllm/models/gemma.py); a partial rotary over the first
  ``partial_rotary_factor`` (0.25) of each head (Qwen3.5's M-RoPE sections coincide for text: the three axes
  share one position); the attention output times ``sigmoid(gate)`` before ``o_proj``.
- Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``): every MLP is Qwen2-MoE's (softmax top k, renormalized and rounded to the
  model dtype, a shared expert scaled by ``sigmoid(shared_expert_gate(x))``); experts per expert or fused.
- Only the full-attention layers have KV-cache tensors; the linear layers keep per-request states by worker row,
  preallocated for ``max_num_seqs`` rows (and the checkpoint slots of prefix caching) before the KV cache is sized
  (asyncllm/models/hybrid.py).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.errors import NotBuiltError
from asyncllm.models.gated_deltanet import GatedDeltaNet
from asyncllm.models.gemma import GemmaRMSNorm
from asyncllm.models.hybrid import HybridBuild, HybridLayer, HybridModel, StateLayersMixin
from asyncllm.models.layers import Attention, LoadedWeight
from asyncllm.models.linear import QKVParallelLinear, RowParallelLinear
from asyncllm.models.llama import DecoderBuild, LlamaForCausalLM
from asyncllm.models.moe import MoECausalLM, MoESpec
from asyncllm.models.mrope import MRopePositions
from asyncllm.models.qwen2_vl import Qwen3VLForConditionalGeneration, _MRopeBuild
from asyncllm.models.qwen3_vl_moe import split_fused_experts

__all__ = ["GatedAttention", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
           "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeTextOnly", "Qwen3_5TextOnly"]

class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate per head, zero-centred q/k norms and a partial rotary."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg, ops = b.hf_config, b.attn_backend.ops
        self.head_dim = cfg.head_dim
        bias = bool(cfg.attention_bias)
        # each head's [query, gate] rows as two "heads": a rank keeps whole pairs
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, 2 * cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias, b.tp, b.dtype)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias, b.tp, b.dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, b.dtype, ops)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, b.dtype, ops)
        self.rotary_emb = b.rotary_emb
        self.attn = Attention(self.num_heads, self.qkv_proj.num_kv_heads, self.head_dim, b.attn_backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        query_gate, key, value = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        tokens = hidden.shape[0]
        pairs = query_gate.view(tokens, self.num_heads, 2, self.head_dim)
        query, gate = self.q_norm(pairs[:, :, 0]), pairs[:, :, 1].reshape(tokens, -1)
        out = self.attn(query, self.k_norm(key), value, kv_cache, metadata,
                        RotaryInputs(positions, self.rotary_emb.cos_sin_cache))
        return self.o_proj(out * torch.sigmoid(gate))


class HybridDecoderLayer(HybridLayer):
    """Zero-centred pre-norms around a linear-attention or a gated full-attention mixer, then the MLP."""

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        cfg = b.hf_config
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)  # noqa: E731
        super().__init__(b, layer_idx, norm,
                         lambda: GatedDeltaNet(cfg, b.dtype, b.state_rows, b.attn_backend.ops),
                         lambda: GatedAttention(b, layer_idx))


class Qwen3_5Model(HybridModel):
    layer_cls = HybridDecoderLayer
    norm_cls = GemmaRMSNorm


class Qwen3_5ForCausalLM(StateLayersMixin, LlamaForCausalLM):
    """Qwen3.5's dense text model."""

    model_cls = Qwen3_5Model

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise NotBuiltError("hidden_act", hf_config.hidden_act, "Qwen3.5 with SiLU")
        super().__init__(hf_config, **kwargs)

    def unread_weight(self, name: str) -> bool:
        """Whether the loader leaves a checkpoint tensor unread (`without_mtp`; a pushed one is refused)."""
        return name.startswith("mtp.")

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(without_mtp(weights))


def without_mtp(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """A checkpoint's weights but its multi-token-prediction layer's (``mtp.``: a draft head's,
    asyncllm/models/qwen_mtp.py)."""
    return ((name, w) for name, w in weights if not name.startswith("mtp."))


def _text_config(hf_config: Any) -> Any:
    """An image-text checkpoint's ``text_config`` with the outer ``tie_word_embeddings``."""
    text_config = copy.copy(hf_config.text_config)
    text_config.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    return text_config


def qwen3_5_text_name(name: str) -> str | None:
    """An image-text checkpoint's weight name as `Qwen3_5ForCausalLM` names it; None for the vision tower's."""
    if name.startswith(("model.visual.", "visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


class Qwen3_5TextOnly(Qwen3_5ForCausalLM):
    """A ``Qwen3_5ForConditionalGeneration`` checkpoint's language model, for text prompts
    (``limit_mm_per_prompt`` of 0 images and 0 videos)."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(_text_config(hf_config), **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((text, w) for name, w in weights if (text := qwen3_5_text_name(name)) is not None)


class Qwen3_5MoeForCausalLM(MoECausalLM, Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: the hybrid layers with a mixture of experts (and a gated shared expert) in every layer."""

    lora_experts = True

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        return MoESpec(hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                       renormalize=True, weights_in_model_dtype=True,
                       shared_expert_size=hf_config.shared_expert_intermediate_size)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.expert_sizes = (int(hf_config.hidden_size), int(hf_config.moe_intermediate_size))
        """(hidden, I): what tells fused experts' two layouts apart."""

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(split_fused_experts(without_mtp(weights), *self.expert_sizes))


class Qwen3_5MoeTextOnly(Qwen3_5MoeForCausalLM):
    """A ``Qwen3_5MoeForConditionalGeneration`` checkpoint's language model, for text prompts."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(_text_config(hf_config), **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((text, w) for name, w in weights if (text := qwen3_5_text_name(name)) is not None)


class Qwen3_5VLModel(MRopePositions, Qwen3_5Model):
    """The hybrid stack for images: ``[3, T]`` positions rotate the attention layers by the step's M-RoPE table
    (the linear layers use no positions)."""

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        self.rotary_emb = b.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        with self.layer_positions(positions) as flat:
            return super().forward(input_ids, flat, kv_caches, metadata, inputs_embeds)


class Qwen3_5VLLanguageModel(_MRopeBuild, Qwen3_5ForCausalLM):
    """Qwen3.5's decoder under its vision tower: interleaved M-RoPE over the rotated quarter of each head."""

    model_cls = Qwen3_5VLModel
    interleaved_mrope = True
    default_mrope_section = (11, 11, 10)


class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3.5 with images and videos: Qwen3-VL's tower without deepstack mergers (asyncllm/models/qwen3_vision.py),
    its processing and M-RoPE positions (asyncllm/models/qwen2_vl.py), over the hybrid decoder."""

    language_model_cls = Qwen3_5VLLanguageModel
    keeps_request_states = True
    takes_state_rows = True
    kv_cache_layers = staticmethod(StateLayersMixin.kv_cache_layers)

    @property
    def checkpoint_slots(self) -> int:
        return self.language_model.checkpoint_slots


class Qwen3_5MoeVLLanguageModel(_MRopeBuild, Qwen3_5MoeForCausalLM):
    model_cls = Qwen3_5VLModel
    interleaved_mrope = True
    default_mrope_section = (11, 11, 10)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """Qwen3.5-MoE with images and videos: the same tower and processing over the MoE hybrid decoder."""

    language_model_cls = Qwen3_5MoeVLLanguageModel
    is_moe = True
    """The loader passes ``expert_parallel`` (to the decoder)."""
    lora_experts = True
    """Adapters on its experts too, as the text model takes them (asyncllm/models/lora_experts.py)."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        return Qwen3_5MoeForCausalLM.moe_spec(hf_config, layer_idx)
