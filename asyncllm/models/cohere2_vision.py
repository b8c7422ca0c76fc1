"""Cohere's Command A Vision (CohereLabs/command-a-vision-07-2025): ``Cohere2VisionForConditionalGeneration``.

The image processor (asyncllm/mm/cohere2_vision_images.py, in place of transformers' torchvision-only one) cuts an
image into up to ``max_patches`` tiles of the tower's ``image_size`` by its aspect ratio, plus a thumbnail of the
whole image (a lone tile when it does not split). Each tile goes through SigLIP's tower (siglip.py; its
``last_hidden_state``, ``post_layernorm`` applied), its patches shuffled ``downsample_factor`` x ``downsample_factor``
into one feature (idefics3.py's `pixel_shuffle`, the same order as transformers'), then the projector: ``linear_1``,
SwiGLU over its two halves (``silu(gate) * x``, the gate the second half), ``linear_2``, into the Cohere2 decoder
(cohere.py). It is Aya Vision's (aya_vision.py) without the LayerNorm and with the last layer normed.

In the prompt an image's ``<|IMG_PATCH|>`` (the tokenizer's ``image_token``) becomes what transformers'
``Cohere2VisionProcessor`` writes: ``<|START_OF_IMG|>``, then per tile its ``<|IMG_PATCH|>`` rows and
``<|IMG_LINE_BREAK|>``, the thumbnail last, ``<|END_OF_IMG|>``. Each tile is one item (`mm_image_pieces`, as Aya
Vision's), so the line breaks keep their own embeddings and each tile is cached and encoded on its own.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.cohere2_vision_images import Cohere2VisionImages
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.models.aya_vision import AyaVisionForConditionalGeneration
from asyncllm.models.cohere import Cohere2ForCausalLM
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.idefics3 import pixel_shuffle
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.siglip import SiglipVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["Cohere2VisionForConditionalGeneration"]

MARKERS = {"image_token": "<|IMG_PATCH|>", "boi_token": "<|START_OF_IMG|>", "eoi_token": "<|END_OF_IMG|>",
           "img_line_break_token": "<|IMG_LINE_BREAK|>"}
"""The tokenizer's named tokens ``Cohere2VisionProcessor`` writes, and the released tokenizer's values for them."""

_MARKER_IDS: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
"""`marker_ids` by tokenizer: looked up once, not once per image."""


class Cohere2VisionMultiModalProjector(nn.Module):
    """Pixel shuffle, ``linear_1``, SwiGLU (``silu`` of the second half times the first), ``linear_2``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = int(hf_config.downsample_factor)
        width = hf_config.vision_config.hidden_size * self.scale ** 2
        inner = int(hf_config.alignment_intermediate_size)
        self.linear_1 = nn.Linear(width, inner, dtype=dtype)
        self.linear_2 = nn.Linear(inner // 2, hf_config.text_config.hidden_size, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x, gate = self.linear_1(pixel_shuffle(patches.contiguous(), self.scale)).chunk(2, dim=-1)
        return self.linear_2(F.silu(gate) * x)


def marker_ids(tokenizer: Any) -> dict[str, int]:
    """The ids of the tokenizer's `MARKERS` (its own names for them where it has them), looked up on its first call;
    a tokenizer without one is a `ConfigError`."""
    ids = _MARKER_IDS.get(tokenizer)
    if ids is None:
        ids = _MARKER_IDS[tokenizer] = _lookup_marker_ids(tokenizer)
    return ids


def _lookup_marker_ids(tokenizer: Any) -> dict[str, int]:
    ids = {}
    for name, default in MARKERS.items():
        text = getattr(tokenizer, name, None) or default
        token = tokenizer.convert_tokens_to_ids(text)
        if token is None or token == tokenizer.unk_token_id:
            raise ConfigError("model", type(tokenizer).__name__, f"a Command A Vision tokenizer with {text} ({name})")
        ids[name] = int(token)
    return ids


def _check_config(hf_config: Any) -> None:
    """`NotBuiltError` for the settings transformers' Command A Vision allows that are not built here."""
    vision = hf_config.vision_config
    if vision.model_type != "siglip_vision_model":
        raise NotBuiltError("vision_config.model_type", vision.model_type, "a SigLIP tower")


class Cohere2VisionForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """A SigLIP tower, pixel shuffle and a SwiGLU projector before the Cohere2 decoder; each tile one item."""

    mm_string_placeholder = False
    """A "string" chat's media parts are refused: vLLM's placeholder text differs from the marker token
    (`MultiModalProcessor.placeholder_text`)."""

    supports_encoder_data_parallel = True
    mm_image_processor_class = Cohere2VisionImages
    """transformers' ``Cohere2VisionImageProcessor`` needs torchvision: this stands in for it (asyncllm/mm/)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        _check_config(hf_config)
        self.language_model = build_decoder(hf_config, {"cohere2": Cohere2ForCausalLM}, "Command A Vision",
                                            mm_encoder_tp_mode, dtype=dtype, tp=tp, attn_backend=attn_backend,
                                            max_position=max_position, **decoder_options)
        self.vision_tower = SiglipVisionTower(hf_config.vision_config, TensorParallel(), dtype)
        self.multi_modal_projector = Cohere2VisionMultiModalProjector(hf_config, dtype)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_of(hf_config: Any, tokenizer: Any) -> int:
        """The prompt token that marks an image: the tokenizer's ``image_token`` (``<|IMG_PATCH|>``, what the chat
        template writes; each becomes the image's rows)."""
        return marker_ids(tokenizer)["image_token"]

    @staticmethod
    def mm_pixel_values(processed: np.ndarray) -> np.ndarray:
        """One image's ``(tiles, 3, S, S)`` float32 tiles (the thumbnail last)."""
        return processed

    @staticmethod
    def mm_check_image_processor(hf_config: Any, image_processor: Cohere2VisionImages) -> None:
        """`ConfigError` where the image processor's ``patch_size`` is not the model's tokens per side of a tile (its
        tower's patches per side over ``downsample_factor``): transformers' ``Cohere2VisionProcessor`` writes
        ``patch_size ** 2`` placeholders per tile, so the two must agree."""
        vision = hf_config.vision_config
        side = vision.image_size // vision.patch_size // int(hf_config.downsample_factor)
        if image_processor.settings.patch_size != side:
            raise ConfigError("patch_size", image_processor.settings.patch_size,
                              f"{side}, the model's tokens per side of a tile (vision_config.image_size / "
                              f"vision_config.patch_size / downsample_factor)")

    mm_placeholder_length = staticmethod(AyaVisionForConditionalGeneration.mm_placeholder_length)
    """Feature rows of one tile: its patches over ``downsample_factor ** 2`` (Aya Vision's)."""
    mm_image_placeholder_id = staticmethod(AyaVisionForConditionalGeneration.mm_image_placeholder_id)
    """``<|IMG_PATCH|>`` (``image_token_id``), once per feature row (Aya Vision's)."""

    @staticmethod
    def mm_image_pieces(hf_config: Any, tokenizer: Any, processed: np.ndarray) -> list[VideoPiece]:
        """One piece per tile, the thumbnail last: ``<|START_OF_IMG|>`` before the first, ``<|IMG_LINE_BREAK|>``
        after each and ``<|END_OF_IMG|>`` after the last."""
        ids, tiles = marker_ids(tokenizer), len(processed)
        return [VideoPiece([ids["boi_token"]] if i == 0 else [], slice(i, i + 1),
                           [ids["img_line_break_token"]] + ([ids["eoi_token"]] if i == tiles - 1 else []))
                for i in range(tiles)]

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 1, 3, S, S]`` tiles -> ``[N, tile features, text hidden]``."""
        return self.multi_modal_projector(self.vision_tower(pixel_values.flatten(0, 1)))

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers' names (``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``,
        ``model.language_model.*``, ``lm_head``) and the original ones, as LLaVA's; SigLIP's pooling head (unused,
        as in transformers) is left unread."""
        weights = ((name, w) for name, w in weights if not normalize_llava_name(name).startswith("vision_tower.head."))
        return load_vision_language_weights(self, weights, normalize_llava_name, "Command A Vision", ("position_ids",))
