"""Phi-4-multimodal's image processing without torchvision: an image -> its global view and HD crops, packed.

transformers' ``Phi4MultimodalImageProcessor`` exists only for torchvision, which the CPU machines cannot import beside
their torch build, so this follows it step for step in torch (`Phi4MultimodalImages`, loaded from the checkpoint's
settings in place of ``AutoImageProcessor``):

- `crop_grid`: ``ceil(width / S) x ceil(height / S)`` crops of ``S`` (``size``: 448) pixels, or, past ``dynamic_hd``
  crops, the grid of at most ``dynamic_hd`` whose aspect ratio is closest to the image's (a tie goes to the larger
  grid when the image covers more than half of it);
- the image is resized (torchvision's antialiased bilinear, on the uint8 image) to fill the grid on one side keeping
  its aspect ratio, padded with white to the whole grid, rescaled and normalized in float32; the global view is that
  canvas resized (bicubic, not antialiased, in float32) to one crop;
- each crop's patch mask (``S / patch_size`` patches a side) is 0 on the patch columns and rows that are all padding.

An image is one item: ``[1 + crops, 3 * S * S + P * P + 1]`` float32, a row per view (the global view first, then the
crops row by row), each its pixels, its patch mask and the grid's column count (`pack_views`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError
from asyncllm.mm.image_ops import BICUBIC, TorchImageProcessor, normalize_like_torchvision, resize_like_torchvision

__all__ = ["Phi4MultimodalImageSettings", "Phi4MultimodalImages", "crop_grid", "pack_views", "unpack_views"]


@dataclass(frozen=True)
class Phi4MultimodalImageSettings:
    """``Phi4MultimodalImageProcessor``'s settings (its defaults)."""

    size: tuple[int, int] = (448, 448)
    patch_size: int = 14
    dynamic_hd: int = 36
    resample: int = BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True
    do_resize: bool = True


def _closest_ratio(aspect: float, width: int, height: int, crop: int, max_num: int) -> tuple[int, int]:
    ratios = sorted({(i, j) for n in range(1, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                     if i * j <= max_num}, key=lambda r: r[0] * r[1])
    best, best_diff = (1, 1), float("inf")
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * crop * crop * ratio[0] * ratio[1]:
            best = ratio
    return best


def crop_grid(height: int, width: int, crop: int, max_num: int) -> tuple[int, int]:
    """(columns, rows) of the crops of a ``height x width`` image (transformers' ``dynamic_preprocess``)."""
    cols, rows = math.ceil(width / crop), math.ceil(height / crop)
    if cols * rows > max_num:
        return _closest_ratio(width / height, width, height, crop, max_num)
    return cols, rows


def pack_views(views: np.ndarray, masks: np.ndarray, cols: int) -> np.ndarray:
    """``[V, 3, S, S]`` views and ``[V, P, P]`` patch masks -> ``[V, 3 S S + P P + 1]``, the column count last."""
    count = views.shape[0]
    return np.concatenate([views.reshape(count, -1), masks.reshape(count, -1),
                           np.full((count, 1), cols, np.float32)], axis=1).astype(np.float32, copy=False)


def unpack_views(values: Any, size: int, patches: int) -> tuple[Any, Any, int]:
    """`pack_views`' inverse over a batch ``[N, V, ...]``: ``[N, V, 3, S, S]`` views, ``[N, V, P, P]`` masks and the
    column count of the first image (a batch shares its shape, not its grid: read each image's itself)."""
    pixels = 3 * size * size
    views = values[..., :pixels].reshape(*values.shape[:2], 3, size, size)
    masks = values[..., pixels:pixels + patches * patches].reshape(*values.shape[:2], patches, patches)
    return views, masks, values[..., -1]


class Phi4MultimodalImages(TorchImageProcessor):
    """``Phi4MultimodalImageProcessor`` in torch (`TorchImageProcessor`): one image -> its packed views."""

    settings_cls = Phi4MultimodalImageSettings

    def __init__(self, settings: Phi4MultimodalImageSettings) -> None:
        if settings.size[0] != settings.size[1]:
            raise ConfigError("size", settings.size, "a square crop (height == width)")
        if settings.resample != BICUBIC:
            raise NotBuiltError("resample", settings.resample, "Phi-4-multimodal's global view resized other than "
                                                               "bicubic (3)")
        if settings.dynamic_hd < 1:
            raise ConfigError("dynamic_hd", settings.dynamic_hd, "at least 1")
        super().__init__(settings)

    def process(self, image: Any) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        s, crop = self.settings, self.settings.size[0]
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
        height, width = pixels.shape[-2:]
        cols, rows = crop_grid(height, width, crop, s.dynamic_hd)
        canvas_w, canvas_h = crop * cols, crop * rows
        if canvas_w / width < canvas_h / height:
            new_w, new_h = canvas_w, int(height * (canvas_w / width))
        else:
            new_w, new_h = int(width * (canvas_h / height)), canvas_h
        if min(new_h, canvas_h) < 10 or min(new_w, canvas_w) < 10:
            raise InvalidRequestError("image", f"the aspect ratio is too extreme ({width} x {height})")
        resized = resize_like_torchvision(pixels, new_h, new_w)
        canvas = F.pad(resized, [0, canvas_w - new_w, 0, canvas_h - new_h], value=255)
        canvas = normalize_like_torchvision(canvas, s)
        whole = canvas if canvas_h == canvas_w == crop else F.interpolate(
            canvas, size=(crop, crop), mode="bicubic", align_corners=False, antialias=False)
        crops = canvas.reshape(3, rows, crop, cols, crop).permute(1, 3, 0, 2, 4).reshape(-1, 3, crop, crop)
        views = torch.cat([whole, crops]).numpy()
        return pack_views(views, self._masks(cols, rows, canvas_w - new_w, canvas_h - new_h), cols)

    def _masks(self, cols: int, rows: int, pad_w: int, pad_h: int) -> np.ndarray:
        """``[1 + crops, P, P]``: the global view's all ones, then each crop's (padding patches 0)."""
        patch = self.settings.patch_size
        side = self.settings.size[0] // patch
        mask = np.ones((rows * side, cols * side), np.float32)
        if pad_w >= patch:
            mask[:, -(pad_w // patch):] = 0
        if pad_h >= patch:
            mask[-(pad_h // patch):, :] = 0
        crops = mask.reshape(rows, side, cols, side).transpose(0, 2, 1, 3).reshape(-1, side, side)
        return np.concatenate([np.ones((1, side, side), np.float32), crops])
