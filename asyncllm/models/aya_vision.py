"""Cohere's Aya Vision (CohereLabs/aya-vision-8b / 32b): ``AyaVisionForConditionalGeneration``.

The checkpoint's image processor (GotOcr2's) cuts an image into up to ``max_patches`` tiles of the tower's
``image_size`` by its aspect ratio, plus a thumbnail of the whole image (a lone tile when it does not split). Each
tile goes through SigLIP's tower (siglip.py; the ``vision_feature_layer`` hidden state, not normed), its patches
shuffled ``downsample_factor`` x ``downsample_factor`` into one feature (idefics3.py's `pixel_shuffle`, the same
order as transformers'), then the projector: LayerNorm, ``linear_1``, SwiGLU over its two halves (``silu(gate) * x``,
the gate the second half), ``linear_2``, into the Cohere / Cohere2 decoder (cohere.py).

In the prompt an image's ``<image>`` becomes what transformers' ``AyaVisionProcessor`` writes:
``<|START_OF_IMG|>``, then per tile ``TILE_i`` and its ``<|IMG_PATCH|>`` rows, then ``TILE_GLOBAL`` and the
thumbnail's rows, ``<|END_OF_IMG|>``. Each tile is one item (`mm_image_pieces`, as Idefics3's), so the tile text
keeps its own embeddings and each tile is cached and encoded on its own.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.idefics3 import pixel_shuffle
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.siglip import SiglipVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["AyaVisionForConditionalGeneration"]

IMAGE, START, END, PATCH = "<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>"
TILE, TILE_GLOBAL = "TILE", "TILE_GLOBAL"


class AyaVisionMultiModalProjector(nn.Module):
    """Pixel shuffle, LayerNorm, ``linear_1``, SwiGLU (``silu`` of the second half times the first), ``linear_2``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = int(hf_config.downsample_factor)
        width = hf_config.vision_config.hidden_size * self.scale ** 2
        hidden = hf_config.text_config.hidden_size
        inner = int(getattr(hf_config, "alignment_intermediate_size", None) or hidden)
        self.layernorm = nn.LayerNorm(width, eps=hf_config.adapter_layer_norm_eps, dtype=dtype)
        self.linear_1 = nn.Linear(width, inner, dtype=dtype)
        self.linear_2 = nn.Linear(inner // 2, hidden, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x, gate = self.linear_1(self.layernorm(pixel_shuffle(patches.contiguous(), self.scale))).chunk(2, dim=-1)
        return self.linear_2(F.silu(gate) * x)


def _check_config(hf_config: Any) -> None:
    """`NotBuiltError` for the settings transformers' Aya Vision allows that are not built here."""
    vision = hf_config.vision_config
    if vision.model_type != "siglip_vision_model":
        raise NotBuiltError("vision_config.model_type", vision.model_type, "a SigLIP tower")
    if not isinstance(hf_config.vision_feature_layer, int):
        raise NotBuiltError("vision_feature_layer", hf_config.vision_feature_layer, "one layer (an int)")
    if hf_config.vision_feature_select_strategy != "full":
        raise NotBuiltError("vision_feature_select_strategy", hf_config.vision_feature_select_strategy, "'full'")


class AyaVisionForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """A SigLIP tower, pixel shuffle and a SwiGLU projector before the Cohere decoder; each tile one item."""

    supports_encoder_data_parallel = True

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        _check_config(hf_config)
        self.language_model = build_decoder(hf_config, {"cohere2": Cohere2ForCausalLM, "cohere": CohereForCausalLM},
                                            "Aya Vision", mm_encoder_tp_mode, dtype=dtype, tp=tp,
                                            attn_backend=attn_backend, max_position=max_position, **decoder_options)
        self.vision_tower = SiglipVisionTower(hf_config.vision_config, TensorParallel(), dtype,
                                              feature_layer=int(hf_config.vision_feature_layer))
        self.multi_modal_projector = AyaVisionMultiModalProjector(hf_config, dtype)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_of(hf_config: Any, tokenizer: Any) -> int:
        """The prompt token that marks an image: the tokenizer's ``<image>`` (what the chat template writes). A
        tokenizer that splits it (transformers' processor replaces the text, never the tokens) gets it added as a
        special token on the host: its id only marks where the image goes, replaced before the model sees it."""
        ids = tokenizer.encode(IMAGE, add_special_tokens=False)
        if len(ids) != 1:
            tokenizer.add_tokens([IMAGE], special_tokens=True)
            ids = tokenizer.encode(IMAGE, add_special_tokens=False)
        return int(ids[0])

    @staticmethod
    def mm_processor_call_kwargs(hf_config: Any) -> dict[str, Any]:
        """What ``AyaVisionProcessor`` passes its image processor: tiles by the aspect ratio."""
        return {"crop_to_patches": True}

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's ``(tiles, 3, S, S)`` float32 tiles (the thumbnail last)."""
        return np.asarray(processed["pixel_values"]).astype("float32", copy=False)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """Feature rows of one tile: its patches over ``downsample_factor ** 2``."""
        vision = hf_config.vision_config
        return (vision.image_size // vision.patch_size // int(hf_config.downsample_factor)) ** 2

    @staticmethod
    def mm_image_placeholder_id(hf_config: Any) -> int:
        """``<|IMG_PATCH|>``, once per feature row."""
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_image_pieces(hf_config: Any, tokenizer: Any, processed: Any) -> list[VideoPiece]:
        """One piece per tile, the thumbnail last: ``<|START_OF_IMG|>`` and ``TILE_1`` before the first, ``TILE_i``
        before the others, ``TILE_GLOBAL`` before the thumbnail and ``<|END_OF_IMG|>`` after it, each text tokenized
        as the tokenizer reads it after the run before it."""
        tiles = int(np.asarray(processed["num_patches"]).reshape(-1)[0])
        patch = int(hf_config.image_token_id)

        def ids(text: str, after_patch: bool) -> list[int]:
            out = [int(t) for t in tokenizer.encode((PATCH if after_patch else "") + text, add_special_tokens=False)]
            return out[1:] if after_patch and out[:1] == [patch] else out

        texts = [f"{TILE}_{i}" for i in range(1, tiles)] + [TILE_GLOBAL]
        texts[0] = START + texts[0]
        return [VideoPiece(ids(text, i > 0), slice(i, i + 1), ids(END, True) if i == tiles - 1 else [])
                for i, text in enumerate(texts)]

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 1, 3, S, S]`` tiles -> ``[N, tile features, text hidden]``."""
        return self.multi_modal_projector(self.vision_tower(pixel_values.flatten(0, 1)))

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers' names (``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``,
        ``model.language_model.*``, ``lm_head``) and the original ones, as LLaVA's."""
        return load_vision_language_weights(self, weights, normalize_llava_name, "Aya Vision", ("position_ids",))
