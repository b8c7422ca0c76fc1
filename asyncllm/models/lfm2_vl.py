"""Liquid AI's LFM2-VL (LiquidAI/LFM2-VL-450M / 1.6B / 3B): ``Lfm2VlForConditionalGeneration``.

An image is processed into tiles (asyncllm/mm/lfm2_vl_images.py: one tile at its own size, or ``tile_size`` tiles
of a large image plus its thumbnail), each of any patch rows x cols. Each tile goes through SigLIP2's NaFlex tower
(siglip2.py: positions resized to its grid, the last layer normed), its patches unshuffled ``downsample_factor`` x
``downsample_factor`` into one feature (`pixel_unshuffle`: the block's patches row by row), then the projector
(LayerNorm with ``projector_use_layernorm``, ``linear_1``, ``projector_hidden_act``, ``linear_2``) into the LFM2
hybrid decoder (lfm2.py: its conv layers keep per-request states, as any LFM2's).

In the prompt an image's ``<image>`` becomes what transformers' ``Lfm2VlProcessor`` writes: ``<|image_start|>``,
then per tile ``<|img_row_R_col_C|>`` and its ``<image>`` run, ``<|img_thumbnail|>`` and the thumbnail's run,
``<|image_end|>`` (a tile alone: only its run between the two; no markers without ``use_image_special_tokens``).
Each tile is one item (`mm_image_pieces`, as Aya Vision's), so the markers keep their own embeddings and each tile
is cached and encoded on its own.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.mm.lfm2_vl_images import Lfm2VlImage, Lfm2VlImages
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.models.clip import activation
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.lfm2 import Lfm2ForCausalLM
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.siglip2 import Siglip2VisionTower
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["Lfm2VlForConditionalGeneration", "pixel_unshuffle"]

START, END, THUMBNAIL = "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"
_DECODERS = {"lfm2": Lfm2ForCausalLM}


def pixel_unshuffle(x: torch.Tensor, rows: int, cols: int, factor: int) -> torch.Tensor:
    """``[N, rows * cols, D]`` patches -> ``[N, rows * cols / factor^2, D * factor^2]``: each ``factor x factor``
    block one feature, its patches row by row (transformers' LFM2-VL order), the blocks row by row."""
    n, _, dim = x.shape
    x = x.view(n, rows // factor, factor, cols // factor, factor, dim).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, (rows // factor) * (cols // factor), factor * factor * dim)


class Lfm2VlMultiModalProjector(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.factor = int(hf_config.downsample_factor)
        width = hf_config.vision_config.hidden_size * self.factor ** 2
        inner, bias = int(hf_config.projector_hidden_size), bool(hf_config.projector_bias)
        self.layer_norm = nn.LayerNorm(width, dtype=dtype) if hf_config.projector_use_layernorm else None
        self.linear_1 = nn.Linear(width, inner, bias=bias, dtype=dtype)
        self.act = activation(hf_config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(inner, hf_config.text_config.hidden_size, bias=bias, dtype=dtype)

    def forward(self, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        x = pixel_unshuffle(patches, rows, cols, self.factor)
        x = x if self.layer_norm is None else self.layer_norm(x)
        return self.linear_2(self.act(self.linear_1(x)))


def _check_config(hf_config: Any) -> None:
    vision = hf_config.vision_config
    if vision.model_type != "siglip2_vision_model":
        raise NotBuiltError("vision_config.model_type", vision.model_type, "an LFM2-VL tower other than SigLIP2's")


class Lfm2VlForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """SigLIP2's NaFlex tower, pixel unshuffle and an MLP projector before the LFM2 decoder; each tile one item."""

    supports_encoder_data_parallel = True
    decoder_classes = _DECODERS
    """The decoder by ``text_config.model_type``: it shapes the KV cache (its attention layers only)."""
    keeps_request_states = True
    """The conv layers' states per worker row, as LFM2's (asyncllm/models/hybrid.py)."""
    takes_state_rows = True
    mm_image_processor_class = Lfm2VlImages
    """transformers' ``Lfm2VlImageProcessor`` needs torchvision: this stands in for it (asyncllm/mm/)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        _check_config(hf_config)
        self.language_model = build_decoder(hf_config, _DECODERS, "LFM2-VL", mm_encoder_tp_mode, dtype=dtype, tp=tp,
                                            attn_backend=attn_backend, max_position=max_position, **decoder_options)
        self.vision_tower = Siglip2VisionTower(hf_config.vision_config, TensorParallel(), dtype)
        self.multi_modal_projector = Lfm2VlMultiModalProjector(hf_config, dtype)

    @property
    def checkpoint_slots(self) -> int:
        return self.language_model.checkpoint_slots

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_pixel_values(processed: Lfm2VlImage) -> Any:
        """One image's tiles, each ``(patch rows, patch cols, patch values)`` float32 (the thumbnail last)."""
        return processed.tiles

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """Features of one ``(1, rows, cols, D)`` tile: its patches over ``downsample_factor ** 2``."""
        factor = int(hf_config.downsample_factor)
        return (pixel_shape[-3] // factor) * (pixel_shape[-2] // factor)

    @staticmethod
    def mm_image_pieces(hf_config: Any, tokenizer: Any, processed: Lfm2VlImage) -> list[VideoPiece]:
        """One piece per tile, the markers of transformers' processor before (and ``<|image_end|>`` after) them."""
        def ids(text: str) -> list[int]:
            return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] if text else []

        marked = processed.use_image_special_tokens
        texts = [f"<|img_row_{r + 1}_col_{c + 1}|>" for r in range(processed.rows) for c in range(processed.cols)]
        texts = (texts if len(texts) > 1 else [""]) + ([THUMBNAIL] if processed.thumbnail else [])
        texts = [text if marked else "" for text in texts]
        texts[0] = (START if marked else "") + texts[0]
        last = len(texts) - 1
        return [VideoPiece(ids(text), slice(i, i + 1), ids(END) if i == last and marked else [])
                for i, text in enumerate(texts)]

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 1, rows, cols, D]`` tiles of one shape -> ``[N, tile features, text hidden]``."""
        tiles = pixel_values.flatten(0, 1)
        rows, cols = tiles.shape[1:3]
        return self.multi_modal_projector(self.vision_tower(tiles), rows, cols)

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers' names (``model.vision_tower.*``, ``model.multi_modal_projector.*``,
        ``model.language_model.*``, ``lm_head``) and the original ones (``vision_tower.vision_model.*``)."""
        return load_vision_language_weights(self, weights, normalize_llava_name, "LFM2-VL", ("position_ids",))
