"""Idefics3 and SmolVLM (HuggingFaceM4/Idefics3-8B-Llama3, HuggingFaceTB/SmolVLM-256M / 500M / 2.2B-Instruct,
SmolVLM2 on images): ``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``.

The checkpoint's image processor resizes an image (longest edge ``size["longest_edge"]``) and cuts it into
``rows x cols`` tiles of ``max_image_size``, plus the whole image as one more tile (``rows = cols = 0``: that tile
alone). Each tile is encoded by a SigLIP-style tower (siglip.py's: patch convolution, learned positions, CLIP's
layers, ``post_layernorm``), its patches shuffled ``scale_factor`` x ``scale_factor`` into one feature
(`pixel_shuffle`), projected (``modality_projection``, no bias) into the Llama decoder's width.

In the prompt each tile is a run of ``<image>`` tokens between text tokens (``<fake_token_around_image>``,
``<row_i_col_j>``, a newline after each row, ``<global-img>`` before the whole image's), as transformers' processor
writes them: each tile is one item (`mm_image_pieces`), so the text between the runs keeps its own embeddings.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.siglip import SiglipVisionEmbeddings, SiglipVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration", "pixel_shuffle"]

_FAKE, _GLOBAL = "<fake_token_around_image>", "<global-img>"


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``[N, side * side, D]`` -> ``[N, side * side / scale^2, D * scale^2]``, as transformers' Idefics3 shuffles."""
    n, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), dim * scale * scale)


class Idefics3VisionEmbeddings(SiglipVisionEmbeddings):
    """SigLIP's embeddings with transformers' Idefics3 position ids for a whole tile (its bucketized fractional
    coordinates, which equal the patch index for the released sizes)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        n = cfg.image_size // cfg.patch_size
        boundaries = torch.arange(1 / n, 1.0, 1 / n)
        coords = torch.clamp(torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor([float(n)])), max=1 - 1e-6)
        buckets = torch.bucketize(coords, boundaries, right=True)
        self.register_buffer("position_ids", (buckets[:, None] * n + buckets[None, :]).reshape(-1), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patches(pixel_values)
        if patches.shape[1] != self.num_patches:
            raise ValueError(f"{patches.shape[1]} patches, the Idefics3 tower expects {self.num_patches}")
        return patches + self.position_embedding(self.position_ids)


class Idefics3Connector(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = int(hf_config.scale_factor)
        width = hf_config.vision_config.hidden_size * self.scale ** 2
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(width, hf_config.text_config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale))


class Idefics3ForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """A SigLIP-style tower and a pixel-shuffle connector before the Llama decoder; each tile one item."""

    supports_encoder_data_parallel = True

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        self.language_model = build_decoder(hf_config, {"llama": LlamaForCausalLM}, "Idefics3", mm_encoder_tp_mode,
                                            dtype=dtype, tp=tp, attn_backend=attn_backend, max_position=max_position,
                                            **decoder_options)
        self.vision_model = SiglipVisionTower(hf_config.vision_config, TensorParallel(), dtype)
        self.vision_model.embeddings = Idefics3VisionEmbeddings(hf_config.vision_config).to(dtype)
        self.connector = Idefics3Connector(hf_config, dtype)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_processor_call_kwargs(hf_config: Any) -> dict[str, Any]:
        return {"return_row_col_info": True}

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's ``(tiles, 3, S, S)`` float32 tiles (the whole image's last)."""
        return processed["pixel_values"][0].astype("float32", copy=False)

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """Feature rows of one tile: its patches over ``scale_factor ** 2``."""
        vision = hf_config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 // int(hf_config.scale_factor) ** 2

    @staticmethod
    def mm_image_pieces(hf_config: Any, tokenizer: Any, processed: Any) -> list[VideoPiece]:
        """One piece per tile: the text before its ``<image>`` run (and after the last), as transformers'
        processor writes it, tokenized the way its tokenizer reads that text."""
        rows, cols = int(processed["rows"][0][0]), int(processed["cols"][0][0])
        fake, whole = getattr(tokenizer, "fake_image_token", _FAKE), getattr(tokenizer, "global_image_token", _GLOBAL)

        def ids(text: str) -> list[int]:
            return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

        if rows == 0 and cols == 0:
            return [VideoPiece(ids(fake + whole), slice(0, 1), ids(fake))]
        pieces = []
        for row in range(rows):
            for col in range(cols):
                start = "\n" if row and not col else ""
                pieces.append(VideoPiece(ids(f"{start}{fake}<row_{row + 1}_col_{col + 1}>"),
                                         slice(row * cols + col, row * cols + col + 1), []))
        pieces.append(VideoPiece(ids(f"\n\n{fake}{whole}"), slice(rows * cols, rows * cols + 1), ids(fake)))
        return pieces

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 1, 3, S, S]`` tiles -> ``[N, tile features, text hidden]``."""
        return self.connector(self.vision_model(pixel_values.flatten(0, 1)))

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """transformers' names (``model.vision_model.*``, ``model.connector.*``, ``model.text_model.*``,
        ``lm_head``) and the original ones (without ``model.``)."""
        return load_vision_language_weights(self, weights, _normalize, "Idefics3")


def _normalize(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("text_model."):
        return "language_model.model." + name.removeprefix("text_model.")
    return name


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM: Idefics3's model (its videos are not built)."""
