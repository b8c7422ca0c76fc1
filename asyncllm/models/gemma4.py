"""Gemma 4 text (transformers' ``Gemma4ForCausalLM``; the language model of ``Gemma4ForConditionalGeneration``
checkpoints, served for text prompts): the Gemma decoder (gemma.py) with, in transformers' order of operations,

- sliding and global layers of different shapes: ``head_dim`` and ``num_key_value_heads`` for the sliding ones,
  ``per_layer_config`` (from ``global_head_dim`` / ``num_global_key_value_heads``) for the global ones, each
  layer's KV cache in its own shape (`kv_cache_shapes`); the global layers rotate by the ``proportional`` rope;
- per-head RMSNorms on q and k (with weights) and on v (without), attention unscaled (``scaling = 1``);
- ``attention_k_eq_v``: the global layers' values are their keys as projected, before the key norm (the k
  projection loads as both; `Gemma4ForCausalLM.load_weights`);
- KV sharing: the last ``num_kv_shared_layers`` layers compute no keys or values; each attends over the cache of
  the last earlier layer of its type (`kv_cache_layout`), which it shares; their MLPs are twice as wide with
  ``use_double_wide_mlp``;
- per-layer inputs (``hidden_size_per_layer_input``): a second embedding table (``[vocab, layers * P]``) and a
  projection of the token embedding give each layer a ``P``-wide input, which gates a residual branch after the MLP;
- a mixture of experts beside the dense MLP (``enable_moe_block``, Gemma 4 26B-A4B): its own router (a scale-free
  norm, a learned scale, softmax top-k renormalised, times a per-expert scale) and GELU-tanh experts, the two
  branches normed apart and summed;
- each layer's output times its ``layer_scalar``; the RMSNorm is ``x / rms(x) * w`` (not ``1 + w``) in float32.

Images: gemma4_mm.py. Pipeline stages: gemma4_stages.py. Not built (refused by name): ``use_bidirectional_attention=
"all"``, audio and video, pre-quantized 26B-A4B checkpoints (fused experts).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.attention.selector import AttentionBackend
from asyncllm.kernels import reference
from asyncllm.models.embedding import VocabParallelEmbedding
from asyncllm.models.gemma import GemmaBuild, GemmaForCausalLM, GemmaMLP
from asyncllm.models.layers import Attention, LoadedWeight, TensorParallel, kv_heads_per_rank, new_param
from asyncllm.models.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncllm.models.llama import sliding_window_of
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec, ReplicatedLinear
from asyncllm.models.qwen3_vl_moe import per_expert_weights
from asyncllm.models.rotary import RotaryEmbedding
from asyncllm.models.gemma4_config import KVCacheLayout, check_gemma4, kv_cache_layout, layer_attention_shape
from asyncllm.models.gemma4_stages import Gemma4Stages, check_stage_kv_sharing
from asyncllm.models.pipeline import PPMissingLayer, in_missing_part
from asyncllm.models.vision_language import decoder_weight_name

__all__ = ["Gemma4ForCausalLM", "Gemma4TextOnly", "LanguageModelOnly", "gemma4_rms_norm", "kv_cache_layout", "layer_attention_shape"]

_ENCODERS = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
"""An image-text-audio checkpoint's weights that the text-only model does not read."""


def gemma4_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' ``Gemma4RMSNorm``: ``x * (mean(x^2) + eps) ** -0.5`` in float32, times the weight (none:
    no scale) in float32, rounded to x's dtype once."""
    x32 = x.float()
    normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (normed if weight is None else normed * weight.float()).to(x.dtype)


class Gemma4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = new_param(dim, dtype=dtype) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma4_rms_norm(x, self.weight, self.eps)


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times ``scale``, the factor rounded to the model dtype first (as transformers)."""

    def __init__(self, vocab_size: int, dim: int, scale: float, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__(vocab_size, dim, tp, dtype)
        self.register_buffer("embed_scale", torch.tensor(scale, dtype=torch.float32).to(dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale


@dataclass(frozen=True)
class Gemma4Build(GemmaBuild):
    layout: KVCacheLayout | None = None


class Gemma4Attention(nn.Module):
    def __init__(self, b: Gemma4Build, layer_idx: int) -> None:
        super().__init__()
        cfg, tp, layout = b.hf_config, b.tp, b.layout
        assert layout is not None
        kv_heads, head_dim = layer_attention_shape(cfg, layer_idx)
        layer_type = cfg.layer_types[layer_idx]
        bias = bool(getattr(cfg, "attention_bias", False))
        self.head_dim, self.shares_kv = head_dim, layout.shares[layer_idx]
        self.k_eq_v = bool(getattr(cfg, "attention_k_eq_v", False)) and layer_type == "full_attention"
        """The values are the keys as projected (one matrix loaded as both; `Gemma4ForCausalLM.load_weights`)."""
        heads = cfg.num_attention_heads
        if self.shares_kv:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * head_dim, bias, tp, b.dtype)
            local_kv_heads = kv_heads_per_rank(kv_heads, tp.size)
        else:
            self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, heads, kv_heads, bias, tp, b.dtype)
            self.k_norm = Gemma4RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype)
            self.v_norm = Gemma4RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype, with_scale=False)
            local_kv_heads = self.qkv_proj.num_kv_heads
        self.q_norm = Gemma4RMSNorm(head_dim, cfg.rms_norm_eps, b.dtype)
        self.o_proj = RowParallelLinear(heads * head_dim, cfg.hidden_size, bias, tp, b.dtype)
        self.rotary_emb = b.rotary_by_layer_type[layer_type]
        self.attn = Attention(tp.split(heads), local_kv_heads, head_dim, b.attn_backend,
                              sliding_window_of(cfg, layer_idx), scale=1.0)
        self.sees_images_both_ways = (layer_type == "sliding_attention"
                                      and getattr(cfg, "use_bidirectional_attention", None) == "vision")
        """An image's rows see each other in the sliding layers only; the global layers stay causal."""

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if metadata.attend_limit is not None and not self.sees_images_both_ways:
            metadata = dataclasses.replace(metadata, attend_limit=None)
        if self.shares_kv:  # the source layer wrote this step's keys and values: attend over its cache
            query = self.q_norm(self.q_proj(hidden).view(num_tokens, -1, self.head_dim))
            query, _ = reference.apply_rotary(query, query[:, :0], positions, self.rotary_emb.cos_sin_cache)
            return self.o_proj(self.attn(query, None, None, kv_cache, metadata))
        query, key, value = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        query, key, value = self.q_norm(query), self.k_norm(key), self.v_norm(value)
        rotary = RotaryInputs(positions, self.rotary_emb.cos_sin_cache)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata, rotary))


class Gemma4Router(nn.Module):
    """Softmax top-k over ``proj(norm(x) * scale / sqrt(hidden))``, renormalised, times ``per_expert_scale``."""

    def __init__(self, spec: MoESpec, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = ReplicatedLinear(spec.num_experts, hidden, dtype)
        self.scale = new_param(hidden, dtype=dtype)
        self.per_expert_scale = new_param(spec.num_experts, dtype=dtype)
        self.top_k, self.eps, self.root = spec.top_k, eps, hidden**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(gemma4_rms_norm(x, None, self.eps) * self.scale * self.root)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, b: Gemma4Build, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        assert b.layout is not None
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps

        def norm(dim: int = hidden) -> Gemma4RMSNorm:
            return Gemma4RMSNorm(dim, eps, b.dtype)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(b, layer_idx)
        wide = bool(getattr(cfg, "use_double_wide_mlp", False)) and b.layout.shares[layer_idx]
        self.mlp = GemmaMLP(b, cfg.intermediate_size * (2 if wide else 1))
        spec = Gemma4ForCausalLM.moe_spec(cfg, layer_idx)
        self.has_moe = spec is not None
        if spec is not None:
            self.router = Gemma4Router(spec, hidden, eps, b.dtype)
            self.experts = FusedMoE(spec, hidden, b)
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
        self.per_layer_size = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer_size:
            self.per_layer_input_gate = ReplicatedLinear(self.per_layer_size, hidden, b.dtype)
            self.per_layer_projection = ReplicatedLinear(hidden, self.per_layer_size, b.dtype)
            self.post_per_layer_input_norm = norm()
            self.gelu_tanh = lambda x: F.gelu(x, approximate="tanh")
        self.layer_scalar = new_param(1, dtype=b.dtype)
        self.uses_kv_cache = not b.layout.shares[layer_idx]
        """A KV-sharing layer has no cache of its own (a pipeline stage counts its caches by this)."""

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, metadata)
        residual = hidden + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.has_moe:
            weights, ids = self.router(residual)
            experts = self.experts(self.pre_feedforward_layernorm_2(residual), weights, ids)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        hidden = residual + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gate = self.gelu_tanh(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar


class Gemma4Model(Gemma4Stages, nn.Module):
    layer_cls: type[nn.Module] = Gemma4DecoderLayer

    def __init__(self, b: Gemma4Build) -> None:
        super().__init__()
        cfg, stage = b.hf_config, b.pipeline  # a pipeline stage: its layers; the per-layer parts on the first
        assert b.layout is not None
        check_stage_kv_sharing(cfg, stage)
        first, last = stage is None or stage.is_first, stage is None or stage.is_last
        embeds = stage is None or stage.holds_embeddings(bool(getattr(cfg, "tie_word_embeddings", False)))
        self.cache_of_layer = b.layout.cache_of_layer
        self.embed_tokens = (ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.hidden_size**0.5, b.tp, b.dtype)
                             if embeds else PPMissingLayer())
        self.layers = nn.ModuleList(self.layer_cls(b, i) if stage is None or stage.owns_layer(i) else PPMissingLayer()
                                    for i in range(cfg.num_hidden_layers))
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype) if last else PPMissingLayer()
        self.stream_width = cfg.hidden_size
        self.soft_token_ids: torch.Tensor | None = None
        """An image-text model's image (video, audio) token ids: their rows take the pad token's per-layer input."""
        self.pad_token_id = 0
        self.per_layer_size = per_layer = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
        if per_layer and first:
            width = cfg.num_hidden_layers * per_layer
            self.embed_tokens_per_layer = ScaledEmbedding(cfg.vocab_size_per_layer_input, width, per_layer**0.5,
                                                          b.tp, b.dtype)
            self.per_layer_model_projection = ReplicatedLinear(width, cfg.hidden_size, b.dtype)
            self.per_layer_projection_norm = Gemma4RMSNorm(per_layer, cfg.rms_norm_eps, b.dtype)
            self.projection_scale = cfg.hidden_size**-0.5
        elif per_layer:  # made on the first stage and sent on (gemma4_stages.py)
            self.embed_tokens_per_layer = PPMissingLayer()
            self.per_layer_model_projection = PPMissingLayer()
            self.per_layer_projection_norm = PPMissingLayer()

    def kv_sharing_pairs(self) -> list[tuple[Attention, Attention]]:
        """(a KV-sharing layer's attention, the attention of the layer whose cache it reads) for this stage's layers
        (a stage holds both: `check_stage_kv_sharing`): the reader reads an fp8 cache with the writer's calibrated
        scales (asyncllm/models/kv_scales.py)."""
        owned = [(i, layer.self_attn) for i, layer in enumerate(self.layers) if not isinstance(layer, PPMissingLayer)]
        writers = {self.cache_of_layer[i]: own.attn for i, own in owned if not own.shares_kv}
        return [(own.attn, writers[self.cache_of_layer[i]]) for i, own in owned if own.shares_kv]

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[T, layers, P]``: the token's own per-layer embedding plus the normed projection of its embedding,
        times ``2 ** -0.5`` (transformers' ``get_per_layer_inputs`` and ``project_per_layer_inputs``)."""
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_size)
        if self.soft_token_ids is not None:  # image rows: the pad token's own part (transformers' llm_input_ids)
            soft = torch.isin(input_ids, self.soft_token_ids.to(input_ids.device))
            input_ids = torch.where(soft, self.pad_token_id, input_ids)
        own = self.embed_tokens_per_layer(input_ids).reshape(shape)
        projected = self.per_layer_model_projection(embeds) * self.projection_scale
        return (self.per_layer_projection_norm(projected.reshape(shape)) + own) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        stream, per_layer = self.embed_stream(input_ids, inputs_embeds)
        stream = self.run_layers(range(len(self.layers)), stream, per_layer, 0, positions, kv_caches, metadata)
        return self.norm(self._merge(stream))


class Gemma4ForCausalLM(MoECausalLM, GemmaForCausalLM):
    """Gemma 4's text decoder (dense, with per-layer inputs and KV sharing, or with experts)."""

    model_cls = Gemma4Model  # type: ignore[assignment]

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if not getattr(hf_config, "enable_moe_block", False):
            return None
        return MoESpec(int(hf_config.num_experts), int(hf_config.top_k_experts), int(hf_config.moe_intermediate_size),
                       renormalize=True, weights_in_model_dtype=False, activation="gelu_tanh")

    @classmethod
    def kv_cache_layers(cls, hf_config: Any) -> int:
        return len(kv_cache_layout(hf_config).shapes)

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        """Each KV cache's (total KV heads, head_dim): sliding and global layers differ."""
        return list(kv_cache_layout(hf_config).shapes)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> Gemma4Build:
        check_gemma4(hf_config)
        ropes: dict[str, RotaryEmbedding] = {}
        for i, layer_type in enumerate(hf_config.layer_types):
            if layer_type not in ropes:
                ropes[layer_type] = RotaryEmbedding(hf_config, layer_attention_shape(hf_config, i)[1], max_position,
                                                    layer_type)
        build = GemmaBuild(hf_config, cls.decoder_flags(hf_config), dtype, tp, attn_backend, next(iter(ropes.values())),
                           cls.make_mlp, expert_parallel, ropes)
        fields = {f.name: getattr(build, f.name) for f in dataclasses.fields(build)}
        return Gemma4Build(**fields, layout=kv_cache_layout(hf_config))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        layout = kv_cache_layout(hf_config)
        self.shared_layers = {i for i, shares in enumerate(layout.shares) if shares}
        self.k_eq_v_layers = {i for i, layer in enumerate(self.model.layers) if not isinstance(layer, PPMissingLayer)
                              and not layer.self_attn.shares_kv and layer.self_attn.k_eq_v}
        self.expert_sizes = (int(hf_config.hidden_size), int(getattr(hf_config, "moe_intermediate_size", 0) or 0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def checkpoint_weight_names(self) -> set[str]:
        """As the Llama decoder's, without the values of the layers whose values are their keys."""
        return super().checkpoint_weight_names() - {f"model.layers.{i}.self_attn.v_proj.weight"
                                                    for i in self.k_eq_v_layers}

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(self._checkpoint_weights(weights))

    def _checkpoint_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """The checkpoint as the layers take it: fused experts cut per expert, the k projection of a layer whose
        values are its keys loaded as its v projection too, the KV-sharing layers' unused K/V weights dropped."""
        for name, weight in weights:
            if self.pipeline is not None and in_missing_part(self, name):
                continue  # another pipeline stage's (its fused experts not read)
            layer, module = _layer_module(name)
            if layer in self.shared_layers and module in ("k_proj", "v_proj", "k_norm", "v_norm"):
                continue
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                full = weight if isinstance(weight, torch.Tensor) else weight[:]
                yield from per_expert_weights(name, full, *self.expert_sizes)
                continue
            yield name, weight
            if layer in self.k_eq_v_layers and module == "k_proj":
                yield name.replace(".k_proj.", ".v_proj."), weight

    def lora_also_parts(self, param_name: str, part: object) -> tuple[object, ...]:
        """A layer whose values are its keys: an adapter of its k projection adapts its values too (transformers'
        values are that projection's output, adapter included)."""
        return ("v",) if part == "k" and _layer_module(param_name)[0] in self.k_eq_v_layers else ()

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        """A KV-sharing layer's ``q_proj`` is a projection of its own (no fused q/k/v)."""
        layer, module = _layer_module(ckpt_name)
        if layer in self.shared_layers and module == "q_proj":
            return ckpt_name, None
        return super()._packed(ckpt_name)


def _layer_module(name: str) -> tuple[int, str]:
    """(layer, attention module) of ``model.layers.{layer}.self_attn.{module}...``; (-1, "") for other names."""
    parts = name.split(".")
    if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn":
        return int(parts[2]), parts[4]
    return -1, ""


class LanguageModelOnly:
    """Mixin before a Gemma decoder class: an image-text(-audio) checkpoint's language model, for text prompts (its
    towers are not read)."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        text_config = copy.copy(hf_config.text_config)
        text_config.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        super().__init__(text_config, **kwargs)  # type: ignore[call-arg]

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        text = ((text_name, w) for name, w in weights if (text_name := decoder_weight_name(name, _ENCODERS)))
        return super().load_weights(text)  # type: ignore[misc]


class Gemma4TextOnly(LanguageModelOnly, Gemma4ForCausalLM):
    """A ``Gemma4ForConditionalGeneration`` checkpoint's language model, for text prompts (its vision and audio
    towers are not read)."""
