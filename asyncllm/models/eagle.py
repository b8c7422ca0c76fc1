"""EAGLE draft heads: speculative decoding with ``method="eagle"`` / ``"eagle3"`` (docs/speculative.md).

An EAGLE head is a decoder layer (or a few) that predicts the token after
next from the target's own hidden states: at position ``p`` it reads the
embedding of token ``p + 1`` and the target's hidden state at ``p``.

- **EAGLE-1** (and HASS): ``fc`` maps ``[embedding, target's final hidden
  state]`` (2 x hidden) to hidden; Llama layers follow, the first without its
  input norm; the output (the residual stream, no final norm) goes through the
  target's LM head. The target's embeddings are used (vLLM loads none from the
  head's checkpoint either). HASS (``add_para_norm``) RMS-normalizes both
  inputs before ``fc``.
- **EAGLE-3**: the target's inputs of three layers (``(2, L // 2, L - 3)``, or
  the head config's ``eagle_aux_hidden_state_layer_ids``) are concatenated and
  ``fc`` maps them to hidden; the first layer's attention reads
  ``[norm(embedding), hidden_norm(hidden)]`` (2 x hidden); a final ``norm`` and
  the head's own LM head over its ``draft_vocab_size`` tokens, each mapped to
  the target's id by ``d2t`` (``target = draft + d2t[draft]``). Its own
  embeddings when the checkpoint has them, else the target's.

Either way the next draft reads the head's own output (EAGLE-3: before its
final norm) in place of the target's hidden state. The checkpoints' names are
read as published (``midlayer.`` is EAGLE-3's first layer; ``t2d`` is not
needed). For an image-text target (Qwen2-VL family, Llama 4, LLaVA-style, Gemma
3) the head reads its language model, attends causally over image rows and may
rotate by M-RoPE: asyncllm/models/eagle_targets.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.models.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.eagle_targets import head_mrope, normalize_head_rope, target_decoder
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel, copy_weight, head_dim_of
from asyncllm.models.linear import ColumnParallelLinear, QKVParallelLinear
from asyncllm.models.llama import DecoderBuild, LlamaDecoderLayer, LlamaForCausalLM
from asyncllm.models.mrope import MRopePositions, MRotaryEmbedding
from asyncllm.spec.config import SPEC_FIELD

__all__ = ["EAGLE3_ARCHITECTURES", "Eagle3LlamaForCausalLM", "EagleLlamaForCausalLM", "TargetReader",
           "eagle3_aux_layers", "load_head_config", "speculators_kind", "target_embeddings"]

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
"""What EAGLE-3 heads' config.json name (EAGLE-1 heads name ``LlamaForCausalLM``)."""


_SPECULATORS_EAGLE3_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")


def _raw_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def speculators_kind(path: str) -> str | None:
    """A speculators-format head's ``speculators_model_type`` ("eagle3", ...); None for any other checkpoint."""
    return _raw_config(path).get("speculators_model_type")


def load_head_config(path: str) -> Any:
    """An EAGLE head's config: its config.json as transformers reads it, or, for a head in the speculators format
    (``speculators_model_type``: RedHat's ``*-speculator.eagle3`` releases), its ``transformer_layer_config`` with
    the EAGLE-3 fields on it (``norm_before_residual`` true unless it says otherwise), as vLLM reads those."""
    from transformers import LlamaConfig

    from asyncllm.models.checkpoint import load_hf_config

    raw = _raw_config(path)
    kind = raw.get("speculators_model_type")
    if kind is None:
        return normalize_head_rope(load_hf_config(path))
    if kind != "eagle3":
        raise NotBuiltError(SPEC_FIELD, path, f"a speculators-format {kind!r} head (its eagle3 heads are "
                                                        "read)")
    layer = dict(raw.get("transformer_layer_config") or {})
    layer.pop("model_type", None)
    extra = {key: raw[key] for key in _SPECULATORS_EAGLE3_KEYS if raw.get(key) is not None}
    config = LlamaConfig(**layer, **extra, norm_before_residual=raw.get("norm_before_residual", True))
    config.architectures = ["Eagle3LlamaForCausalLM"]
    config.speculators_model_type = kind
    return normalize_head_rope(config)


def target_embeddings(target: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The target's embedding rows of ``input_ids``, unscaled (Gemma scales its embeddings in its own forward; a
    head reads the table, as vLLM's share it)."""
    return VocabParallelEmbedding.forward(target_decoder(target).embed_tokens, input_ids)


def eagle3_aux_layers(draft_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads: its config's ``eagle_aux_hidden_state_layer_ids``,
    else vLLM's default ``(2, L // 2, L - 3)``."""
    ids = getattr(draft_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (getattr(draft_config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return (2, num_target_layers // 2, num_target_layers - 3)
    return tuple(int(i) for i in ids)


class TargetReader:
    """What a draft head reading the target shares (EAGLE heads here, MTP layers in mtp.py): the target model it
    borrows (a tuple: not a submodule), its embedding table, its step output as the head reads it."""

    target: tuple[Any, ...] = ()

    def share_target(self, target: Any) -> None:
        """Borrow the target's embeddings (and, for EAGLE-1, its LM head)."""
        self.target = (target,)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return target_embeddings(self.target[0], input_ids)

    def combine(self, final_hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's step output as the head reads it: its final hidden states (EAGLE-3: its layers' inputs)."""
        return final_hidden


class _EagleHead(TargetReader, MRopePositions, LlamaForCausalLM):
    """What both EAGLE heads share: Llama layers over the paged draft cache, ``fc`` over ``fc_input_size``
    features (replicated: every rank has the whole hidden state)."""

    def __init__(self, hf_config: Any, fc_input_size: int, *, dtype: torch.dtype, tp: TensorParallel,
                 attn_backend: Any, max_position: int) -> None:
        nn.Module.__init__(self)
        build = self.decoder_build(hf_config, dtype, tp, attn_backend, max_position, False)
        mrope, interleaved = head_mrope(hf_config)
        if mrope:  # a head trained on an M-RoPE target's positions (asyncllm/models/eagle_targets.py)
            build = dataclasses.replace(build, rotary_emb=MRotaryEmbedding(hf_config, head_dim_of(hf_config),
                                                                           max_position, interleaved))
        self.rotary_emb = build.rotary_emb
        self.pipeline = None
        self.tie_word_embeddings = False
        self.layers = nn.ModuleList(self.make_layer(build, i) for i in range(hf_config.num_hidden_layers))
        self.fc = ColumnParallelLinear(fc_input_size, hf_config.hidden_size, False, TensorParallel(), dtype)

    def make_layer(self, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return LlamaDecoderLayer(b, layer_idx)

    def run_layers(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                   kv_caches: list[torch.Tensor], metadata: Any, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        for layer, kv_cache in zip(self.layers[start:], kv_caches[start:], strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        assert residual is not None
        return hidden, residual

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The head's checkpoint names (``layers.0.``, ``midlayer.``, ``fc``, ...) as this module's."""
        return super().load_weights(kept for name, weight in weights
                                    if (kept := self.own_weight(name.removeprefix("model."), weight)) is not None)

    def own_weight(self, name: str, weight: LoadedWeight) -> tuple[str, LoadedWeight] | None:
        """(this module's name, weight), or None for a weight the head does not use."""
        if name.startswith(("embed_tokens.", "lm_head.")):
            return None  # EAGLE-1: the target's
        return name, weight


class EagleLlamaForCausalLM(_EagleHead):
    """EAGLE-1 / HASS: ``fc([embedding, target hidden])``, Llama layers, the target's LM head."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, 2 * hf_config.hidden_size, **kwargs)
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer has none
        self.para_norm = bool(getattr(hf_config, "add_para_norm", False))
        if self.para_norm:  # HASS
            dtype, eps = kwargs["dtype"], hf_config.rms_norm_eps
            self.embedding_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
            self.hidden_states_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden for the logits, hidden the next draft reads): the same tensor for EAGLE-1."""
        embeds = self.embed(input_ids)
        if self.para_norm:
            embeds, hidden = self.embedding_layernorm(embeds), self.hidden_states_layernorm(hidden)
        hidden, residual = self.run_layers(positions, self.fc(torch.cat([embeds, hidden], dim=-1)), None,
                                           kv_caches, attn_metadata, 0)
        out = hidden + residual
        return out, out

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy target ids from the head's output rows (the target's LM head)."""
        return self.target[0].compute_logits(hidden).argmax(dim=-1)

    def own_weight(self, name: str, weight: LoadedWeight) -> tuple[str, LoadedWeight] | None:
        name = {"fusion_fc.weight": "fc.weight",
                "pre_lm_head_layernorm.weight": "hidden_states_layernorm.weight"}.get(name, name)
        return super().own_weight(name, weight)


class Eagle3FirstLayer(LlamaDecoderLayer):
    """EAGLE-3's first layer: attention over ``[input_layernorm(embedding), hidden_norm(hidden)]``."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.fused_decode_rows = 0
        self.self_attn.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, head_dim_of(cfg), cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, b.flags.qkv_bias, b.tp, b.dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward_first(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                      kv_cache: torch.Tensor, metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it), as `LlamaDecoderLayer.forward` returns them."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.to_residual(self.self_attn(positions, x, kv_cache, metadata))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.to_residual(self.mlp(x)), residual


class Eagle3LlamaForCausalLM(_EagleHead):
    """EAGLE-3: ``fc`` over three target layers' inputs, a first layer over embedding and hidden, its own norm and
    LM head over ``draft_vocab_size`` tokens mapped to the target's by ``d2t``."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        target_hidden = getattr(hf_config, "target_hidden_size", None) or hf_config.hidden_size
        super().__init__(hf_config, 3 * target_hidden, **kwargs)
        dtype, tp = kwargs["dtype"], kwargs["tp"]
        hidden = hf_config.hidden_size
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps, dtype, kwargs["attn_backend"].ops)
        self.draft_vocab_size = getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size
        self.target_vocab_size = hf_config.vocab_size
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, tp, dtype)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)
        self.has_d2t = False
        """Whether the checkpoint mapped its tokens (a head over the whole vocabulary needs no ``d2t``)."""
        self.embed_tokens = (VocabParallelEmbedding(hf_config.vocab_size, hidden, tp, dtype)
                             if getattr(hf_config, "draft_has_embeddings", False) else None)
        """The head's own embeddings, where its checkpoint has them (the runner says so in the config)."""

    def make_layer(self, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return Eagle3FirstLayer(b, layer_idx) if layer_idx == 0 else LlamaDecoderLayer(b, layer_idx)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) if self.embed_tokens is None else self.embed_tokens(input_ids)

    def combine(self, final_hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's step output as the head reads it: ``fc`` over its layers' inputs."""
        return self.fc(torch.cat(aux, dim=-1))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden for the logits, the residual stream before the norm: what the next draft reads)."""
        first: Eagle3FirstLayer = self.layers[0]  # type: ignore[assignment]
        out, residual = first.forward_first(positions, self.embed(input_ids), hidden, kv_caches[0], attn_metadata)
        if len(self.layers) > 1:
            out, residual = self.run_layers(positions, out, residual, kv_caches, attn_metadata, 1)
        return self.norm(out, residual)

    def draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy target ids: the head's LM head over its own vocabulary, mapped by ``d2t``."""
        ids = self.lm_head(hidden).argmax(dim=-1)
        return ids + self.d2t[ids] if self.has_d2t else ids

    def own_weight(self, name: str, weight: LoadedWeight) -> tuple[str, LoadedWeight] | None:
        name = name.replace("midlayer.", "layers.0.")
        if name == "t2d" or (name.startswith("embed_tokens.") and self.embed_tokens is None):
            return None
        if name == "d2t":
            try:
                copy_weight(self.d2t, weight)
            except ValueError as exc:
                raise ConfigError(SPEC_FIELD, "d2t",
                                  f"one entry per draft token (draft_vocab_size={self.draft_vocab_size}), but it {exc}")
            self.has_d2t = True
            return None
        return name, weight

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        loaded = super().load_weights(weights)
        if self.draft_vocab_size != self.target_vocab_size and not self.has_d2t:
            raise ConfigError(SPEC_FIELD, "d2t", f"an EAGLE-3 head over {self.draft_vocab_size} of the "
                                                            f"{self.target_vocab_size} tokens has their ids (d2t)")
        return loaded
