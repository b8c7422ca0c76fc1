"""LLaVA-NeXT-Video (LLaVA-NeXT-Video-7B-hf, -7B-DPO-hf, -34B-hf): ``LlavaNextVideoForConditionalGeneration``.

LLaVA-NeXT's images as they are (llava_next.py), and videos: each frame goes through the same CLIP tower (its
``vision_feature_layer``, the CLS feature dropped), its grid of patch features is pooled ``spatial_pool_stride`` x
``spatial_pool_stride`` (``spatial_pool_mode`` "average" or "max"; "conv", a learned pooling, is a
`NotBuiltError`) and projected; the video's features are its frames' in order, no newline embeddings, one run of
``<video>`` placeholders (transformers' ``get_video_features``). The frames are the caller's and are resized and
cropped as transformers' video processor does (asyncllm/mm/llava_video.py); a video's item is its ``[1, T, C, H, W]``
pixels, so a batch of videos has one axis more than a batch of images' tiles and `embed_multimodal` tells them apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from asyncllm.errors import NotBuiltError
from asyncllm.mm.llava_video import LlavaVideoProcessing
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.mm.videos import Video
from asyncllm.models.llava_next import LlavaNextForConditionalGeneration

__all__ = ["LlavaNextVideoForConditionalGeneration"]

_POOLS = {"average": F.avg_pool2d, "max": F.max_pool2d}
"""``spatial_pool_mode`` -> the pooling (transformers' ``LlavaNextVideoPooler``)."""


class LlavaNextVideoForConditionalGeneration(LlavaNextForConditionalGeneration):
    """LLaVA-NeXT with videos: frames through the tower, pooled, projected, one run of placeholders a video."""

    mm_video_processing = LlavaVideoProcessing
    """The host processor's frame processing (resize, center crop, normalize)."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if hf_config.spatial_pool_mode not in _POOLS:
            raise NotBuiltError("spatial_pool_mode", hf_config.spatial_pool_mode,
                                f"LLaVA-NeXT-Video's pooling of {', '.join(map(repr, _POOLS))}")
        super().__init__(hf_config, **kwargs)
        self.pool = _POOLS[hf_config.spatial_pool_mode]
        self.pool_stride = int(hf_config.spatial_pool_stride)

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_video_token_id(hf_config: Any) -> int:
        """The prompt token that marks a video (``<video>``)."""
        return int(hf_config.video_token_id)

    @staticmethod
    def mm_video_pieces(hf_config: Any, tokenizer: Any, video: Video, grid: tuple[int, int, int]) -> list[VideoPiece]:
        """A video is one item, one run of placeholders."""
        return [VideoPiece([], slice(0, 1), [])]

    @classmethod
    def mm_placeholder_length_of(cls, hf_config: Any, pixel_values: np.ndarray) -> int:
        """A video's ``[1, T, C, H, W]``: T frames of pooled features; an image's tiles: LLaVA-NeXT's count."""
        if pixel_values.ndim != 5:
            return super().mm_placeholder_length_of(hf_config, pixel_values)
        patch, stride = hf_config.vision_config.patch_size, hf_config.spatial_pool_stride
        rows, cols = pixel_values.shape[-2] // patch // stride, pixel_values.shape[-1] // patch // stride
        return pixel_values.shape[1] * rows * cols

    def embed_multimodal(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[override]
        """``[N, 1, T, C, H, W]`` videos -> one ``[T x pooled patches, text hidden]`` each; images: LLaVA-NeXT's."""
        if pixel_values.dim() != 6:
            return super().embed_multimodal(pixel_values)
        n, frames = pixel_values.shape[0], pixel_values.shape[2]
        features = self.vision_tower(pixel_values.flatten(0, 2))[:, 1:]  # "default" (built alone): no CLS
        side = int(features.shape[1] ** 0.5)
        grid = features.unflatten(1, (side, side)).permute(0, 3, 1, 2)
        pooled = self.pool(grid, kernel_size=self.pool_stride, stride=self.pool_stride).flatten(2).transpose(1, 2)
        projected = self.multi_modal_projector(pooled)
        return list(projected.reshape(n, frames * projected.shape[1], -1))
