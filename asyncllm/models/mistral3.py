"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral-Small-3.1 / 3.2, Magistral-Small, Devstral-Small 2505+,
Ministral 3): Pixtral's vision tower and Mistral 3's projector (pixtral.py) before the Mistral decoder of llama.py
(Ministral 3's: ministral3.py).

An image of ``rows x cols`` merged patches (28 x 28 pixels each) takes ``rows``
runs of ``[IMG] * cols`` in the prompt, each run closed by ``[IMG_BREAK]``, the
last by ``[IMG_END]``, as transformers' ``PixtralProcessor`` writes them. The whole
run is one item: the encoder outputs a row per token, and the break and end
tokens keep their own embeddings (`mm_text_rows`), so chunked prefill and the
caches treat the image as one span. The image's size rides in its item's shape
``(3, H, W)``.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.deepseek import Mistral4ForCausalLM
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.ministral3 import Ministral3ForCausalLM
from asyncllm.models.pixtral import Mistral3Projector, PixtralVisionTower
from asyncllm.models.vision_language import (VisionLanguageModel, build_decoder, load_vision_language_weights,
                                             text_config_of, text_only_class)

__all__ = ["Mistral3ForConditionalGeneration", "PixtralLlavaForConditionalGeneration", "merged_grid"]

IMAGE_BREAK, IMAGE_END = "[IMG_BREAK]", "[IMG_END]"

_DECODERS: dict[str, type[LlamaForCausalLM]] = {
    "mistral": LlamaForCausalLM, "llama": LlamaForCausalLM, "ministral3": Ministral3ForCausalLM,
    "mistral4": Mistral4ForCausalLM,
}
"""The decoders under the tower: Mistral Small 3.1 / 3.2's (Mistral), Ministral 3's (its attention temperature),
Mistral 4's (DeepSeek-V3's latent attention and experts, asyncllm/models/deepseek.py, deepseek_moe.py)."""


def merged_grid(hf_config: Any, pixel_shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of merged patches of an image of ``(3, H, W)`` pixels (Pixtral-12B merges none): a last row or
    column of patches short of a merge is dropped (LightOnOCR's odd grids)."""
    unit = hf_config.vision_config.patch_size * getattr(hf_config, "spatial_merge_size", 1)
    return pixel_shape[-2] // unit, pixel_shape[-1] // unit


def mistral3_text_only(hf_config: Any) -> type:
    """A Mistral 3 checkpoint's language model for text prompts (``limit_mm_per_prompt`` of 0 images: Mistral Small
    3.1 / 3.2, Magistral Small as text), its decoder by ``text_config.model_type``; the tower is not read."""
    model_type = text_config_of(hf_config).model_type
    if model_type not in _DECODERS:
        raise NotBuiltError("text_config.model_type", model_type, f"a Mistral 3 decoder of type {', '.join(_DECODERS)}")
    return text_only_class(_DECODERS[model_type], ("vision_tower.", "multi_modal_projector."))


class Mistral3ForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features replace the ``[IMG]`` placeholders' embeddings; the rest is the Mistral decoder."""

    supports_encoder_data_parallel = True
    """The tower and projector are whole on every rank in either mode, so "data" splits a step's images."""
    decoder_classes = _DECODERS
    """By ``text_config.model_type``: what the KV cache's shape follows (Mistral 4's latent cache)."""

    @staticmethod
    def moe_spec(hf_config: Any, layer_idx: int) -> Any:
        """The decoder's layer ``layer_idx``'s experts (Mistral 4's; ``hf_config``: the text config), for the host's
        check of LoRA adapters (their experts' adapters are not built under the tower)."""
        spec = getattr(_DECODERS.get(hf_config.model_type), "moe_spec", None)
        return None if spec is None else spec(hf_config, layer_idx)

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        if hf_config.vision_config.model_type != "pixtral":
            raise NotBuiltError("vision_config.model_type", hf_config.vision_config.model_type, "a Pixtral tower")
        self.language_model = build_decoder(hf_config, _DECODERS, "Mistral 3", mm_encoder_tp_mode, dtype=dtype, tp=tp,
                                            attn_backend=attn_backend, max_position=max_position, **decoder_options)
        self.vision_tower = PixtralVisionTower(hf_config.vision_config, hf_config.vision_feature_layer, dtype)
        self.multi_modal_projector = Mistral3Projector(hf_config, dtype)
        self.hf_config = hf_config

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image (``[IMG]``)."""
        return int(hf_config.image_token_id if getattr(hf_config, "image_token_id", None) is not None
                   else hf_config.image_token_index)

    @staticmethod
    def mm_processor_call_kwargs(hf_config: Any) -> dict[str, Any]:
        """What ``PixtralProcessor`` passes its image processor: patches of a merged token's size (28 pixels)."""
        return {"patch_size": hf_config.vision_config.patch_size * getattr(hf_config, "spatial_merge_size", 1)}

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's processor output -> its ``(3, H, W)`` float32 pixels (a batch of one is never padded)."""
        height, width = (int(n) for n in processed["image_sizes"][0])
        return processed["pixel_values"][0, :, :height, :width].astype("float32", copy=False)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        rows, cols = merged_grid(hf_config, pixel_shape)
        return rows * (cols + 1)

    @staticmethod
    def mm_placeholder_ids(hf_config: Any, tokenizer: Any, pixel_shape: tuple[int, ...]) -> list[int]:
        """``([IMG] * cols + [IMG_BREAK]) * rows``, the last break an ``[IMG_END]``."""
        rows, cols = merged_grid(hf_config, pixel_shape)
        image, brk, end = (Mistral3ForConditionalGeneration.mm_placeholder_token_id(hf_config),
                           *(int(tokenizer.convert_tokens_to_ids(t)) for t in (IMAGE_BREAK, IMAGE_END)))
        ids = ([image] * cols + [brk]) * rows
        ids[-1] = end
        return ids

    def mm_text_rows(self, pixel_shape: tuple[int, ...]) -> np.ndarray:
        """The item's rows whose tokens keep their own embeddings (the breaks and the end)."""
        rows, cols = merged_grid(self.hf_config, pixel_shape)
        return np.arange(1, rows + 1) * (cols + 1) - 1

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` images of one size -> ``[N, rows * (cols + 1), text hidden]``: each row of merged
        patches' features, then a zero row where its break (or the end) token keeps its embedding."""
        rows, cols = merged_grid(self.hf_config, tuple(pixel_values.shape))
        patches = self.vision_tower(pixel_values)
        merge = self.hf_config.spatial_merge_size
        features = self.multi_modal_projector(patches, rows * merge, cols * merge).view(len(pixel_values), rows, cols, -1)
        out = torch.cat([features, features.new_zeros(len(pixel_values), rows, 1, features.shape[-1])], dim=2)
        return out.view(len(pixel_values), rows * (cols + 1), -1)

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Both layouts (``model.vision_tower.*`` / ``vision_tower.*``, ...) as LLaVA's."""
        return load_vision_language_weights(self, weights, normalize_llava_name, "Mistral 3")


class PixtralLlavaForConditionalGeneration(Mistral3ForConditionalGeneration):
    """Pixtral-12B (``LlavaForConditionalGeneration`` with a Pixtral tower: pixtral-12b, mistral-community's HF
    format): the same tower, rows and breaks with no patch merging (every 16-pixel patch a token), and LLaVA's
    two-layer projector (llava.py) before the Mistral decoder."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        from asyncllm.models.llava import LlavaMultiModalProjector

        VisionLanguageModel.__init__(self)
        if hf_config.vision_feature_select_strategy != "full":
            raise NotBuiltError("vision_feature_select_strategy", hf_config.vision_feature_select_strategy,
                                "Pixtral-12B with 'full' (its tower has no CLS feature)")
        self.language_model = build_decoder(hf_config, _DECODERS, "Pixtral", mm_encoder_tp_mode, dtype=dtype, tp=tp,
                                            attn_backend=attn_backend, max_position=max_position, **decoder_options)
        self.vision_tower = PixtralVisionTower(hf_config.vision_config, hf_config.vision_feature_layer, dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config, TensorParallel(), dtype)
        self.hf_config = hf_config

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` images of one size -> ``[N, rows * (cols + 1), text hidden]``, as Mistral 3's."""
        rows, cols = merged_grid(self.hf_config, tuple(pixel_values.shape))
        features = self.multi_modal_projector(self.vision_tower(pixel_values)).view(len(pixel_values), rows, cols, -1)
        out = torch.cat([features, features.new_zeros(len(pixel_values), rows, 1, features.shape[-1])], dim=2)
        return out.view(len(pixel_values), rows * (cols + 1), -1)
