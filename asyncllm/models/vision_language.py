"""What the vision-language models share: routing a checkpoint's weights to the encoder and the decoder.

LLaVA (llava.py), Qwen2-VL (qwen2_vl.py) and Mistral 3 (mistral3.py) hold an image encoder beside a
``language_model`` decoder: each checkpoint name is mapped to ours by the
model's ``normalize`` function, the decoder's go through its own loader (fused
projections, TP shards), the encoder's straight to their parameters (whose
``weight_loader`` takes the rank's shard).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import ConfigError
from asyncllm.models.layers import LoadedWeight, default_weight_loader
from asyncllm.models.pipeline import PPMissingLayer, in_missing_part

__all__ = ["VisionLanguageModel", "build_decoder", "decoder_weight_name", "image_limit",
           "load_vision_language_weights", "text_config_of", "text_only_class", "vision_language_weight_names"]


def image_limit(model_cls: type, limits: dict[str, int] | None) -> int | None:
    """The images one prompt may hold: ``limit_mm_per_prompt["image"]``, else the model's ``mm_default_image_limit``
    (Mllama's 1: the workers reserve room for that many images' cross-attention states per request); None: any."""
    if limits and "image" in limits:
        return limits["image"]
    return getattr(model_cls, "mm_default_image_limit", None)


def text_config_of(hf_config: Any) -> Any:
    """A copy of ``text_config`` with the checkpoint's ``tie_word_embeddings``, which Qwen2-VL and Mistral 3 keep at
    the top level (a tied checkpoint saves no LM head)."""
    text = copy.copy(hf_config.text_config)
    tie = getattr(hf_config, "tie_word_embeddings", None)
    text.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False) if tie is None else tie)
    return text


def decoder_weight_name(name: str, encoder_prefixes: tuple[str, ...]) -> str | None:
    """An image-text checkpoint's weight name as its decoder alone names it (``model.layers...``), or None for the
    encoder's (names starting with ``encoder_prefixes``); both layouts: the original (``language_model.model.*``)
    and transformers 5's (``model.language_model.*``)."""
    name = name.removeprefix("model.")
    if name.startswith(encoder_prefixes):
        return None
    if name.startswith(("language_model.model.", "language_model.lm_head.")):  # Llama 4's LM head is the decoder's
        return name.removeprefix("language_model.")
    if name.startswith("language_model."):
        return "model." + name.removeprefix("language_model.")
    return name


@functools.lru_cache(maxsize=None)
def text_only_class(decoder_cls: type, encoder_prefixes: tuple[str, ...]) -> type:
    """An image-text checkpoint's language model as a text model: ``decoder_cls`` over `text_config_of`, reading the
    decoder's weights under either layout (`decoder_weight_name`) and not the encoder's (``encoder_prefixes``)."""

    class TextOnly(decoder_cls):  # type: ignore[valid-type, misc]
        def __init__(self, hf_config: Any, **kwargs: Any) -> None:
            super().__init__(text_config_of(hf_config), **kwargs)

        def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
            return super().load_weights((text, w) for name, w in weights
                                        if (text := decoder_weight_name(name, encoder_prefixes)) is not None)

    TextOnly.__name__ = TextOnly.__qualname__ = f"{decoder_cls.__name__}TextOnly"
    return TextOnly


def load_vision_language_weights(model: nn.Module, weights: Iterable[tuple[str, LoadedWeight]],
                                 normalize: Callable[[str], str], family: str,
                                 ignored_suffixes: tuple[str, ...] = ()) -> set[str]:
    """Load ``weights`` into ``model`` (its ``language_model`` and the rest); the names loaded, ours.

    A name matching neither is a `ConfigError` naming it (after all are read), unless it ends with one of
    ``ignored_suffixes`` (buffers some checkpoints carry, e.g. CLIP's ``position_ids``). On a pipeline stage after
    the first the encoder's names are skipped unread (`VisionLanguageModel.drop_encoder`).
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    text: list[tuple[str, LoadedWeight]] = []
    unexpected: list[str] = []
    for raw_name, weight in weights:
        name = normalize(raw_name)
        if name.startswith("language_model."):
            text.append((name.removeprefix("language_model."), weight))
        elif in_missing_part(model, name):
            continue
        elif name in params:
            param = params[name]
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
            except ValueError as exc:
                raise ConfigError("model", raw_name, f"a weight matching config.json, but it {exc}") from exc
            loaded.add(name)
        elif not (ignored_suffixes and name.endswith(ignored_suffixes)):
            unexpected.append(raw_name)
    if unexpected:
        raise ConfigError("model", type(model).__name__, f"a {family} checkpoint; unexpected weights: "
                                                         f"{', '.join(unexpected[:8])}")
    loaded.update("language_model." + name for name in model.language_model.load_weights(text))
    return loaded


def vision_language_weight_names(model: nn.Module) -> set[str]:
    """The checkpoint names ``model`` needs: its decoder's (fused parameters expanded) and its encoder's."""
    names = {"language_model." + name for name in model.language_model.checkpoint_weight_names()}
    names.update(name for name, _ in model.named_parameters() if not name.startswith("language_model."))
    return names


class VisionLanguageModel(nn.Module):
    """An image encoder beside ``self.language_model``: the decoder's entry points delegated to it."""

    language_model: nn.Module

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def checkpoint_weight_names(self) -> set[str]:
        return vision_language_weight_names(self)

    def drop_encoder(self) -> None:
        """A pipeline stage after the first holds the decoder's layers only: every other part (the vision tower,
        the projector) becomes a `PPMissingLayer` (the first stage encodes the images; docs/parallelism.md)."""
        for name, _ in list(self.named_children()):
            if name != "language_model":
                setattr(self, name, PPMissingLayer())


def build_decoder(hf_config: Any, decoders: dict[str, type], family: str, mm_encoder_tp_mode: str,
                  **kwargs: Any) -> nn.Module:
    """The decoder of a vision-language checkpoint whose tower is whole on every rank (either
    ``mm_encoder_tp_mode``): ``decoders[text_config.model_type]`` over `text_config_of` (``kwargs``: its build's,
    a pipeline stage's ``pipeline`` among them); `NotBuiltError` for another decoder type."""
    from asyncllm.errors import NotBuiltError

    if mm_encoder_tp_mode not in ("weights", "data"):
        raise ConfigError("mm_encoder_tp_mode", mm_encoder_tp_mode, "'weights' or 'data'")
    text_config = text_config_of(hf_config)
    decoder_cls = decoders.get(text_config.model_type)
    if decoder_cls is None:
        raise NotBuiltError("text_config.model_type", text_config.model_type,
                            f"a {family} decoder of type {', '.join(decoders)}")
    return decoder_cls(text_config, **kwargs)
