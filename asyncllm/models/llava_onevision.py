"""LLaVA-OneVision (llava-onevision-qwen2-0.5b / 7b / 72b-ov-hf and -si-hf): ``LlavaOnevisionForConditionalGeneration``.

LLaVA-NeXT's anyres tiles and packing (llava_next.py) with a SigLIP tower (siglip.py: no CLS feature, so every
patch's feature is kept, ``vision_feature_select_strategy="full"``; the features of ``vision_feature_layer``, not
normed) before the projector and the Qwen2 decoder, and "anyres_max_N" (``vision_aspect_ratio``): when the unpadded
grid holds more than ``N`` tiles' worth of features (by more than 10 %), it is scaled down bilinearly to about that
many, keeping its aspect, before the newlines are added. Videos are not built (the host refuses them).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.llava import siglip_feature_tower
from asyncllm.models.llava_next import LlavaNextForConditionalGeneration, packed_feature_shape

__all__ = ["LlavaOnevisionForConditionalGeneration"]


class LlavaOnevisionForConditionalGeneration(LlavaNextForConditionalGeneration):
    """LLaVA-NeXT's packing over a SigLIP tower, the grid scaled down past ``anyres_max_N`` tiles."""

    feature_strategy = "full"

    @staticmethod
    def make_vision_tower(hf_config: Any, tp: TensorParallel, dtype: torch.dtype) -> nn.Module:
        if hf_config.vision_config.model_type != "siglip_vision_model":
            raise NotBuiltError("vision_config.model_type", hf_config.vision_config.model_type,
                                "LLaVA-OneVision with a SigLIP tower")
        return siglip_feature_tower(hf_config, TensorParallel(), dtype)

    @staticmethod
    def _encoder_tp(hf_config: Any, tp: TensorParallel, mode: str) -> TensorParallel:
        """The SigLIP tower and the projector are whole on every rank (either mode)."""
        LlavaNextForConditionalGeneration._encoder_tp(hf_config, TensorParallel(), mode)  # checks the mode's name
        return TensorParallel()

    @staticmethod
    def grid_feature_shape(hf_config: Any, orig_h: int, orig_w: int) -> tuple[int, int]:
        """The unpadded grid, scaled by 1 / ratio when it holds ``ratio ** 2`` > 1.21 times ``N`` tiles' features."""
        rows, cols = packed_feature_shape(hf_config, orig_h, orig_w)
        aspect = getattr(hf_config, "vision_aspect_ratio", None) or "anyres_max_9"
        if not aspect.startswith("anyres_max_"):
            raise NotBuiltError("vision_aspect_ratio", aspect, "LLaVA-OneVision's 'anyres_max_N'")
        side = hf_config.vision_config.image_size // hf_config.vision_config.patch_size
        ratio = math.sqrt(rows * cols / (int(aspect.removeprefix("anyres_max_")) * side ** 2))
        return (int(rows // ratio), int(cols // ratio)) if ratio > 1.1 else (rows, cols)
