"""LLaVA-NeXT (LLaVA-1.6: llava-v1.6-mistral-7b-hf, -vicuna-7b/13b-hf, -34b-hf, llama3-llava-next-8b-hf):
``LlavaNextForConditionalGeneration``.

LLaVA's CLIP tower, projector and decoder (llava.py) with "anyres" images: the checkpoint's image processor resizes
each image to the best of ``image_grid_pinpoints`` and cuts it into tiles of the tower's size, plus the whole image
scaled down (the base tile). Every tile is encoded; the grid's features are laid out as one picture, the rows or
columns of padding the resize added are cut off again (by the image's original size, as transformers'
``unpad_image``), an ``image_newline`` embedding ends every row, and the base tile's features go first.

The placeholder length depends on the original size, which the processor reports beside the pixels
(``image_sizes``): the item's array carries it in one extra tile after the real ones (its first two values: the
height and width), so it travels with the pixels through the processor caches and to the workers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import new_param
from asyncllm.models.llava import LlavaForConditionalGeneration

__all__ = ["LlavaNextForConditionalGeneration", "packed_feature_shape"]


def _grid(hf_config: Any, orig_h: int, orig_w: int) -> tuple[int, int]:
    """Tiles per column and per row of the grid the processor chose for an image of this size."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution((orig_h, orig_w), hf_config.image_grid_pinpoints)
    tile = hf_config.vision_config.image_size
    return height // tile, width // tile


def packed_feature_shape(hf_config: Any, orig_h: int, orig_w: int) -> tuple[int, int]:
    """(rows, columns) of the grid's features left after unpadding (transformers' ``unpad_image``)."""
    side = hf_config.vision_config.image_size // hf_config.vision_config.patch_size
    tiles_h, tiles_w = _grid(hf_config, orig_h, orig_w)
    height, width = tiles_h * side, tiles_w * side
    if orig_w / orig_h > width / height:
        new_height = int(round(orig_h * (width / orig_w), 7))
        return height - 2 * ((height - new_height) // 2), width
    new_width = int(round(orig_w * (height / orig_h), 7))
    return height, width - 2 * ((width - new_width) // 2)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA with anyres tiles, unpadded and packed with a newline embedding per row."""

    feature_strategy = "default"
    """The ``vision_feature_select_strategy`` built: CLIP's CLS feature dropped (LLaVA-OneVision: SigLIP's "full")."""
    vision_towers = ("clip_vision_model",)
    """CLIP's alone: the lengths count its dropped CLS row (LLaVA-OneVision builds its own SigLIP tower)."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if hf_config.vision_feature_select_strategy != self.feature_strategy:
            raise NotBuiltError("vision_feature_select_strategy", hf_config.vision_feature_select_strategy,
                                f"{type(self).__name__} with {self.feature_strategy!r}")
        super().__init__(hf_config, **kwargs)
        self.hf_config = hf_config
        self.image_newline = new_param(hf_config.text_config.hidden_size, dtype=kwargs["dtype"])

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_pixel_values(processed: Any) -> np.ndarray:
        """``[tiles + 1, C, H, W]`` float32: the processor's tiles, then one carrying the original height, width."""
        tiles = processed["pixel_values"][0].astype("float32", copy=False)
        size = np.zeros((1, *tiles.shape[1:]), dtype=np.float32)
        size.reshape(-1)[:2] = processed["image_sizes"][0]
        return np.concatenate([tiles, size])

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        raise NotBuiltError("mm_placeholder_length", pixel_shape, "LLaVA-NeXT lengths from the image's size "
                                                                  "(mm_placeholder_length_of)")

    @classmethod
    def mm_placeholder_length_of(cls, hf_config: Any, pixel_values: np.ndarray) -> int:
        """The base tile's features, then each unpadded row of the grid's and its newline."""
        orig_h, orig_w = (int(round(float(v))) for v in pixel_values[-1].reshape(-1)[:2])
        side = hf_config.vision_config.image_size // hf_config.vision_config.patch_size
        rows, cols = cls.grid_feature_shape(hf_config, orig_h, orig_w)
        return side * side + rows * (cols + 1)

    @staticmethod
    def grid_feature_shape(hf_config: Any, orig_h: int, orig_w: int) -> tuple[int, int]:
        """(rows, columns) of the grid's features as packed: unpadded (LLaVA-OneVision: then scaled down)."""
        return packed_feature_shape(hf_config, orig_h, orig_w)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[override]
        """``[N, tiles + 1, C, H, W]`` -> one ``[placeholders, text hidden]`` per image (their lengths differ)."""
        n, tiles = pixel_values.shape[0], pixel_values.shape[1] - 1
        features = super().embed_multimodal(pixel_values[:, :tiles].flatten(0, 1))
        features = features.view(n, tiles, *features.shape[1:])
        sizes = pixel_values[:, -1].flatten(1)[:, :2].round().long().tolist()
        return [self._pack(image, h, w) for image, (h, w) in zip(features, sizes)]

    def _pack(self, tiles: torch.Tensor, orig_h: int, orig_w: int) -> torch.Tensor:
        """One image's ``[tiles, side * side, D]`` features as transformers' ``pack_image_features`` lays them."""
        side = self.hf_config.vision_config.image_size // self.hf_config.vision_config.patch_size
        tiles_h, tiles_w = _grid(self.hf_config, orig_h, orig_w)
        grid = tiles[1:].view(tiles_h, tiles_w, side, side, -1).permute(4, 0, 2, 1, 3)
        grid = grid.reshape(grid.shape[0], tiles_h * side, tiles_w * side)
        rows, cols = packed_feature_shape(self.hf_config, orig_h, orig_w)
        top, left = (grid.shape[1] - rows) // 2, (grid.shape[2] - cols) // 2
        grid = grid[:, top:top + rows, left:left + cols]
        final = self.grid_feature_shape(self.hf_config, orig_h, orig_w)
        if final != (rows, cols):  # LLaVA-OneVision's anyres_max: scaled down, bilinear
            grid = torch.nn.functional.interpolate(grid[None], list(final), mode="bilinear")[0]
            rows, cols = final
        newline = self.image_newline[:, None, None].expand(-1, rows, 1).to(grid.dtype)
        packed = torch.cat([grid, newline], dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat([tiles[0], packed])
