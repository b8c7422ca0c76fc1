"""Gemma 3 text (1B, and the text decoder of the 4B/12B/27B checkpoints): the Gemma decoder
(asyncllm/models/gemma.py) with a Gemma RMSNorm on each query and key head, five sliding-window layers
(``rope_local_base_freq``) to each global one (its own, possibly scaled, rope).

``attn_logit_softcapping`` is read but not applied, as in transformers' Gemma 3 (None in its checkpoints).
An image-text checkpoint (``Gemma3ForConditionalGeneration``) is served as text only: its language model
is this decoder, and the vision tower and projector are not read (`Gemma3TextOnly`)."""

from __future__ import annotations

import copy
from typing import Any, Iterable

from asyncllm.models.gemma import GemmaForCausalLM
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.vision_language import decoder_weight_name

__all__ = ["Gemma3ForCausalLM", "Gemma3TextOnly", "gemma3_text_name"]


class Gemma3ForCausalLM(GemmaForCausalLM):
    qk_norm = True


def gemma3_text_name(name: str) -> str | None:
    """An image-text checkpoint's weight name as `Gemma3ForCausalLM` names it, or None for the image encoder's.

    Both layouts: the original (``language_model.model.*``) and transformers 5's (``model.language_model.*``).
    """
    return decoder_weight_name(name, ("vision_tower.", "multi_modal_projector."))


class Gemma3TextOnly(Gemma3ForCausalLM):
    """A ``Gemma3ForConditionalGeneration`` checkpoint's language model, for text prompts (no images)."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        text_config = copy.copy(hf_config.text_config)
        text_config.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))  # the outer flag ties
        super().__init__(text_config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        text_weights = ((text_name, w) for name, w in weights if (text_name := gemma3_text_name(name)) is not None)
        return super().load_weights(text_weights)
