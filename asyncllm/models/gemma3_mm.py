"""Gemma 3 with images (``Gemma3ForConditionalGeneration``: gemma-3-4b/12b/27b-it): a SigLIP tower (siglip.py),
Gemma 3's projector, and the Gemma 3 decoder of gemma3.py.

An image is one fixed-size crop (the image processor resizes it to the tower's ``image_size``); the tower's
patch features are average-pooled to ``mm_tokens_per_image`` (256) rows, Gemma-RMS-normed and projected to the
decoder's width. In the prompt each ``<start_of_image>`` becomes ``"\\n\\n<start_of_image>"``, the image's
``<image_soft_token>`` rows (one item), ``"<end_of_image>\\n\\n"``, as transformers' ``Gemma3Processor`` writes
it; newline tokens on either side merge as its tokenizer would have merged them (`newline_merges`). The
image's rows attend to each other both ways in the prefill (transformers' block mask over
``token_type_ids``): its item says so (``bidirectional``), the scheduler never ends a prefill chunk inside
it and the attention backends get each query's last visible position (``attend_limit``; docs/gemma.md).

With pan-and-scan (``mm_processor_kwargs={"do_pan_and_scan": True}``) the image processor adds crops of a wide or
tall image to the whole one; each is its own item of 256 both-ways rows, and the prompt holds the text
``Gemma3Processor`` writes around them ("Here is the original image ... and here are some crops to help you see
better ...": `mm_image_pieces`).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.gemma3 import Gemma3ForCausalLM
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.siglip import SiglipVisionTower
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, load_vision_language_weights

__all__ = ["Gemma3ForConditionalGeneration", "newline_merges"]

_MAX_NEWLINES = 32
_ORIGINAL, _CROPS = "Here is the original image ", " and here are some crops to help you see better "
"""``Gemma3Processor``'s text before the whole image and before its pan-and-scan crops."""


def newline_merges(tokenizer: Any) -> dict[tuple[int, int], int]:
    """(newline token, newline token) -> the one token of both runs together, for the runs the tokenizer has a
    single token for (Gemma's has one for 1 to 31 newlines)."""
    runs: dict[int, int] = {}
    for n in range(1, _MAX_NEWLINES):
        ids = tokenizer.encode("\n" * n, add_special_tokens=False)
        if len(ids) == 1:
            runs[n] = int(ids[0])
    return {(runs[a], runs[b]): runs[a + b] for a in runs for b in runs if a + b in runs}


class Gemma3MultiModalProjector(nn.Module):
    """Patch features ``[N, P, vision]`` -> ``[N, mm_tokens_per_image, text]``: a ``k x k`` average pool over the
    patch grid, Gemma's RMSNorm (``1 + weight``, float32), then ``mm_input_projection_weight`` ``[vision, text]``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision = hf_config.vision_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, hf_config.text_config.hidden_size, dtype=dtype), requires_grad=False)
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vision.hidden_size, dtype=dtype), requires_grad=False)
        self.eps = vision.layer_norm_eps
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(round(hf_config.mm_tokens_per_image**0.5))
        if tokens_per_side**2 != hf_config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise NotBuiltError("mm_tokens_per_image", hf_config.mm_tokens_per_image,
                                f"a square number whose side divides the {self.patches_per_side} patches a side")
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, width = patches.shape
        grid = patches.transpose(1, 2).reshape(n, width, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        scale = 1.0 + self.mm_soft_emb_norm.weight.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale
        return torch.matmul(normed.type_as(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3ForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Image features replace the ``<image_soft_token>`` rows' embeddings (after the decoder's embedding scale,
    as transformers); the rest is the Gemma 3 decoder."""

    supports_encoder_data_parallel = True
    """The tower and projector are whole on every rank in either mode, so "data" splits a step's images."""
    mm_bidirectional = True
    """An image's rows attend to each other both ways in the prefill (`asyncllm.protocol.MultiModalItem`)."""
    decoder_classes = {"gemma3_text": Gemma3ForCausalLM}
    """By ``text_config.model_type`` (the decoder an EAGLE head reads: asyncllm/models/eagle_targets.py)."""
    mm_processor_defaults = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                             "pan_and_scan_min_ratio_to_activate": 1.2}
    """What ``Gemma3Processor`` passes its image processor for the pan-and-scan settings a checkpoint leaves null."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        if hf_config.vision_config.model_type != "siglip_vision_model":
            raise NotBuiltError("vision_config.model_type", hf_config.vision_config.model_type, "a SigLIP tower")
        self.language_model = build_decoder(hf_config, self.decoder_classes, "Gemma 3",
                                            mm_encoder_tp_mode, dtype=dtype, tp=tp, attn_backend=attn_backend,
                                            max_position=max_position, **decoder_options)
        self.vision_tower = SiglipVisionTower(hf_config.vision_config, TensorParallel(), dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config, dtype)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image: ``<start_of_image>``."""
        return int(hf_config.boi_token_index)

    @staticmethod
    def mm_image_text(hf_config: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
        """The text around an image's rows: ``"\\n\\n<start_of_image>"`` before, ``"<end_of_image>\\n\\n"`` after."""
        newlines = [int(t) for t in tokenizer.encode("\n\n", add_special_tokens=False)]
        return newlines + [int(hf_config.boi_token_index)], [int(hf_config.eoi_token_index)] + newlines

    @staticmethod
    def mm_token_merges(tokenizer: Any) -> dict[tuple[int, int], int]:
        return newline_merges(tokenizer)

    @staticmethod
    def mm_image_tiled(image_processor: Any) -> bool:
        """Whether an image becomes the whole one and its crops (`mm_image_pieces`): with ``do_pan_and_scan``."""
        return bool(getattr(image_processor, "do_pan_and_scan", False))

    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """One image's processor output -> its ``[1 + crops, 3, S, S]`` float32 pixels (the whole image first)."""
        return processed["pixel_values"].astype("float32", copy=False)

    @staticmethod
    def mm_image_pieces(hf_config: Any, tokenizer: Any, processed: Any) -> list[VideoPiece]:
        """With pan-and-scan: the whole image's piece and one per crop, with ``Gemma3Processor``'s text around them
        (``"Here is the original image "``, the image, ``" and here are some crops to help you see better "``, the
        crops joined by ``" "``; each ``"\\n\\n<start_of_image>"``, its rows, ``"<end_of_image>\\n\\n"``), tokenized
        as its tokenizer reads that text. An image left whole is one piece, as without pan-and-scan."""
        crops = int(np.asarray(processed["num_crops"]).reshape(-1)[0])
        before, after = Gemma3ForConditionalGeneration.mm_image_text(hf_config, tokenizer)
        if not crops:
            return [VideoPiece(before, slice(0, 1), after)]
        boi, eoi = tokenizer.convert_ids_to_tokens([int(hf_config.boi_token_index), int(hf_config.eoi_token_index)])
        texts = [f"{_ORIGINAL}\n\n{boi}", f"{eoi}\n\n{_CROPS}\n\n{boi}"] + [f"{eoi}\n\n \n\n{boi}"] * (crops - 1)
        ids = [[int(t) for t in tokenizer.encode(text, add_special_tokens=False)] for text in texts]
        return [VideoPiece(ids[i], slice(i, i + 1), after if i == crops else []) for i in range(crops + 1)]

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        return int(hf_config.mm_tokens_per_image)

    @staticmethod
    def mm_image_placeholder_id(hf_config: Any) -> int:
        """``<image_soft_token>``, once per feature row."""
        return int(hf_config.image_token_index)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 1, 3, S, S]`` images or crops -> ``[N, mm_tokens_per_image, text hidden]``."""
        return self.multi_modal_projector(self.vision_tower(pixel_values.flatten(0, 1)))

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Both layouts (``model.vision_tower.*`` / ``vision_tower.*``, ...) as LLaVA's; the SigLIP pooling head's
        weights (``vision_use_head``) are left unread, as transformers' Gemma 3 never runs it."""
        used = ((name, w) for name, w in weights if not normalize_llava_name(name).startswith("vision_tower.head."))
        return load_vision_language_weights(self, used, normalize_llava_name, "Gemma 3", ("position_ids",))
