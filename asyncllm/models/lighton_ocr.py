"""LightOnOCR (``LightOnOcrForConditionalGeneration``: LightOnOCR-1B-1025, LightOnOCR-2-1B): Pixtral's vision tower and
Mistral 3's projector (pixtral.py) before the Qwen3 decoder (qwen3.py).

transformers' ``LightOnOcrProcessor`` calls the checkpoint's Pixtral image processor
as it is configured (its own ``patch_size``, 14 pixels: sides in multiples of 14),
and writes ``(H // 28) * (W // 28)`` image tokens for an image of ``H x W`` pixels:
no row breaks and no end token (vLLM's and SGLang's processors agree). The tower
encodes every 14-pixel patch; the projector's 2 x 2 merge drops a last odd row or
column of patches, as transformers' ``unfold`` does. One item an image, its size
in its shape ``(3, H, W)``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable

import torch

from asyncllm.attention.selector import AttentionBackend
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.mistral3 import Mistral3ForConditionalGeneration, merged_grid
from asyncllm.models.pixtral import Mistral3Projector, PixtralVisionTower
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["LightOnOcrForConditionalGeneration", "normalize_lighton_ocr_name"]

_DECODERS = {"qwen3": Qwen3ForCausalLM}
"""The decoder under the tower, by ``text_config.model_type``."""

_PREFIXES = (("model.vision_encoder.", "vision_tower."), ("model.vision_projection.", "multi_modal_projector."),
             ("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
"""transformers' names -> ours (vLLM's mapping of the same checkpoints)."""


def normalize_lighton_ocr_name(name: str) -> str:
    """A LightOnOCR checkpoint's weight name as our modules name it (`_PREFIXES`); others unchanged."""
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return name


def _projector_config(hf_config: Any) -> Any:
    """What `Mistral3Projector` reads, as LightOnOCR's fixes it: bias-free linears and an exact GELU."""
    return SimpleNamespace(vision_config=hf_config.vision_config, text_config=hf_config.text_config,
                           spatial_merge_size=hf_config.spatial_merge_size, projector_hidden_act="gelu",
                           multimodal_projector_bias=False)


class LightOnOcrForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features replace the image tokens' embeddings; the rest is the Qwen3 decoder."""

    supports_encoder_data_parallel = True
    """The tower and projector are whole on every rank in either mode, so "data" splits a step's images."""
    decoder_classes = _DECODERS

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        from asyncllm.errors import NotBuiltError

        super().__init__()
        if hf_config.vision_config.model_type != "pixtral":
            raise NotBuiltError("vision_config.model_type", hf_config.vision_config.model_type, "a Pixtral tower")
        self.language_model = build_decoder(hf_config, _DECODERS, "LightOnOCR", mm_encoder_tp_mode, dtype=dtype,
                                            tp=tp, attn_backend=attn_backend, max_position=max_position,
                                            **decoder_options)
        self.vision_tower = PixtralVisionTower(hf_config.vision_config, -1, dtype)  # the last layer's output
        self.multi_modal_projector = Mistral3Projector(_projector_config(hf_config), dtype)
        self.hf_config = hf_config

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image and each of its placeholders (``<|image_pad|>``)."""
        return int(hf_config.image_token_id)

    mm_pixel_values = Mistral3ForConditionalGeneration.mm_pixel_values

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """One token per merged patch (Mistral 3's grid, with no row breaks)."""
        rows, cols = merged_grid(hf_config, pixel_shape)
        return rows * cols

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` images of one size -> ``[N, rows * cols, text hidden]``, merged patches row-major; the
        projector merges the tower's whole grid of patches (an odd side's last one dropped)."""
        patch = self.hf_config.vision_config.patch_size
        rows, cols = pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch
        return self.multi_modal_projector(self.vision_tower(pixel_values), rows, cols)

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers' layout (``model.vision_encoder.*``, ``model.vision_projection.*``, ...)."""
        return load_vision_language_weights(self, weights, normalize_lighton_ocr_name, "LightOnOCR")
