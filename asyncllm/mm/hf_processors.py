"""The checkpoint's HF processors on the host (asyncllm/mm/processor.py loads them): its image processor, with
``mm_processor_kwargs`` applied and a key that changes nothing refused, and its audio feature extractor."""

from __future__ import annotations

import copy
import os
from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.mm.image_bounds import PIXEL_COUNT_EDGES

__all__ = ["load_feature_extractor", "load_image_processor"]



def load_image_processor(model_path: str, overrides: dict[str, Any], defaults: dict[str, Any] | None = None,
                         processor_cls: Any = None) -> Any:
    """The checkpoint's HF image processor (or the model's ``mm_image_processor_class``, LFM2-VL's stand-in for one
    that needs torchvision) with ``mm_processor_kwargs`` applied, then ``defaults`` for the settings it leaves None
    (Gemma 3's pan-and-scan bounds, which its HF processor passes); a `ConfigError` names a key that changes
    nothing (transformers drops unknown ones without a word). ``overrides`` is left as given (the processor gets
    copies: Qwen-VL's writes its ``max_pixels`` into a ``size`` dict it is given)."""
    from transformers import AutoImageProcessor

    loader = processor_cls or (_MistralImages if _mistral_images(model_path) else AutoImageProcessor)
    processor = loader.from_pretrained(model_path, **copy.deepcopy(overrides))  # Qwen-VL's rewrites a given size dict
    for key, value in (defaults or {}).items():
        if getattr(processor, key, None) is None:
            setattr(processor, key, value)
    if overrides:
        plain = loader.from_pretrained(model_path).to_dict()
        for key, value in overrides.items():
            ignored = loader.from_pretrained(model_path, **copy.deepcopy({key: value})).to_dict() == plain
            if ignored and _setting(plain, key) != value:
                raise ConfigError(f"mm_processor_kwargs.{key}", value,
                                  f"a setting of the model's {type(processor).__name__}")
    return processor


def _setting(settings: dict[str, Any], key: str) -> Any:
    """A processor's `key` setting in its dict (None: it has none), so that a request repeating it is no typo."""
    if key in settings:
        return settings[key]
    size = settings.get("size")
    return size.get(PIXEL_COUNT_EDGES[key]) if key in PIXEL_COUNT_EDGES and isinstance(size, dict) else None


def _mistral_images(model_path: str) -> bool:
    """Whether the checkpoint's image settings are only its params.json's (Mistral's format: Pixtral-12B-2409)."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(model_path, name))

    return not has("preprocessor_config.json") and has("params.json")


class _MistralImages:
    """`load_image_processor`'s loader for Mistral's format (asyncllm/models/mistral_vision_format.py)."""

    @staticmethod
    def from_pretrained(model_path: str, **overrides: Any) -> Any:
        from asyncllm.models.mistral_format import mistral_image_processor

        return mistral_image_processor(model_path, **overrides)


def load_feature_extractor(model_path: str, extractor_cls: Any = None) -> Any:
    """The checkpoint's HF audio feature extractor (Qwen2-Audio's ``WhisperFeatureExtractor``), or the model's
    ``mm_feature_extractor_class`` read from the checkpoint (Granite Speech's, whose HF one needs torchaudio)."""
    if extractor_cls is None:
        from transformers import AutoFeatureExtractor as extractor_cls

    try:
        return extractor_cls.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ConfigError("model", model_path, f"a checkpoint with its audio feature extractor "
                                               f"(preprocessor_config.json: {exc})") from exc

