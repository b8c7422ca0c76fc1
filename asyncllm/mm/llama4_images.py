"""Llama 4's image processing without torchvision: an image -> its tiles (and global view) and their layout.

transformers' ``Llama4ImageProcessor`` exists only for torchvision, which the CPU machines cannot import beside their
torch build, so this follows it step for step in torch (`Llama4Images`, loaded from the checkpoint's
``preprocessor_config.json`` in place of ``AutoImageProcessor``):

- `canvases`: every tile grid of at most ``max_patches`` tiles of ``size`` pixels, in transformers' order (grouped by
  aspect ratio, most tiles first), and `best_canvas`: the one the image fits with the least upscaling (or, none
  upscaling, the least downscaling; the smallest area among equal scales; with ``resize_to_max_canvas`` the
  largest upscaling).
- `fitted_size`: the image resized into that canvas keeping its aspect ratio (upscaled at most to ``size`` per side
  unless ``resize_to_max_canvas``); the rest of the canvas is padded with zeros, then cut into tiles row by row.
- A canvas of several tiles is followed by the whole image resized to one tile (the global view, distorting).
- Rescale and normalize in bfloat16, as transformers' processor does (the values are bfloat16's, kept in float32).

The canvas arithmetic keeps transformers' types (its canvas sizes are int64 tensors, so sums with them run in float32
where its own do), and the resize is LFM2-VL's (torch's antialiased bilinear kernel, as torchvision's on a CPU
tensor), so the pixels equal transformers' processor's on the same machine (tests/unit/test_llama4_images.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.image_ops import BILINEAR, TorchImageProcessor, resize_like_torchvision

__all__ = ["Llama4Image", "Llama4Images", "Llama4ImageSettings", "best_canvas", "canvases", "fitted_size"]


@dataclass(frozen=True)
class Llama4ImageSettings:
    """``Llama4ImageProcessor``'s settings (its defaults)."""

    size: tuple[int, int] = (336, 336)
    """(height, width) of one tile; square."""
    max_patches: int = 16
    resize_to_max_canvas: bool = False
    resample: int = BILINEAR
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True


def canvases(max_patches: int, tile: int) -> list[tuple[int, int]]:
    """(height, width) of every grid of 1 to ``max_patches`` tiles, grouped by aspect ratio in the order each ratio
    first appears going from ``max_patches`` tiles down (transformers' order, which breaks its ties)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for tiles in range(max_patches, 0, -1):
        for rows in sorted(d for d in range(1, tiles + 1) if tiles % d == 0):
            by_ratio.setdefault(rows / (tiles // rows), []).append((rows, tiles // rows))
    return [(rows * tile, cols * tile) for grids in by_ratio.values() for rows, cols in grids]


def best_canvas(height: int, width: int, options: Any, to_max: bool) -> Any:
    """The canvas (an int64 ``[2]`` tensor, as transformers keeps it) that ``height x width`` fits best: the least
    upscaling (the most with ``to_max``), else the least downscaling; the smallest area among equal scales."""
    import torch

    scale_h, scale_w = options[:, 0] / height, options[:, 1] / width
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    chosen = (up.max() if to_max else up.min()) if len(up) else scales[scales < 1].max()
    fits = options[scales == chosen]
    return fits[torch.argmin(fits[:, 0] * fits[:, 1])] if len(fits) > 1 else fits[0]


def fitted_size(height: int, width: int, canvas: Any, s: Llama4ImageSettings) -> tuple[int, int]:
    """The image's size inside ``canvas`` keeping its aspect ratio; without ``resize_to_max_canvas`` a side is
    upscaled at most to the tile's size. A bound taken from the canvas is a tensor: its quotients are float32."""
    bound_h, bound_w = canvas[0], canvas[1]
    if not s.resize_to_max_canvas:
        bound_h, bound_w = min(max(height, s.size[0]), bound_h), min(max(width, s.size[1]), bound_w)
    by_w, by_h = bound_w / width, bound_h / height
    if by_w < by_h:
        new_h, new_w = min(math.floor(height * by_w), bound_h), bound_w
    else:
        new_h, new_w = bound_h, min(math.floor(width * by_h), bound_w)
    return max(int(new_h), 1), max(int(new_w), 1)


@dataclass
class Llama4Image:
    """One processed image: ``(tiles, 3, S, S)`` float32 (the global view last when there are several tiles) and
    its grid of tiles (rows x cols; 1 x 1: the image is one tile, no global view)."""

    tiles: np.ndarray
    rows: int
    cols: int


class Llama4Images(TorchImageProcessor):
    """``Llama4ImageProcessor`` in torch (`TorchImageProcessor`: ``from_pretrained``, ``to_dict``, a call)."""

    settings_cls = Llama4ImageSettings

    def __init__(self, settings: Llama4ImageSettings) -> None:
        if settings.resample != BILINEAR:
            raise NotBuiltError("resample", settings.resample, "Llama 4 resizing other than bilinear (2)")
        if not settings.do_resize:
            raise ConfigError("do_resize", False, "True: Llama 4 always resizes into a canvas of tiles")
        if settings.size[0] != settings.size[1]:
            raise ConfigError("size", settings.size, "a square tile (height == width)")
        if settings.do_normalize and not settings.do_rescale:
            raise NotBuiltError("do_rescale", False, "Llama 4 normalizing without rescaling")
        super().__init__(settings)

    def process(self, image: Any) -> Llama4Image:
        import torch
        import torch.nn.functional as F

        s, tile = self.settings, self.settings.size[0]
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
        height, width = pixels.shape[-2:]
        canvas = best_canvas(height, width, torch.tensor(canvases(s.max_patches, tile)), s.resize_to_max_canvas)
        new_h, new_w = fitted_size(height, width, canvas, s)
        canvas_h, canvas_w = int(canvas[0]), int(canvas[1])
        fitted = F.pad(resize_like_torchvision(pixels, new_h, new_w), [0, canvas_w - new_w, 0, canvas_h - new_h])
        rows, cols = canvas_h // tile, canvas_w // tile
        tiles = self._normalized(fitted).view(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(-1, 3, tile,
                                                                                                        tile)
        if rows * cols > 1:
            tiles = torch.cat([tiles, self._normalized(resize_like_torchvision(pixels, tile, tile))[None]])
        return Llama4Image(tiles.float().numpy(), rows, cols)

    def _normalized(self, pixels: Any) -> Any:
        """A ``(1, 3, H, W)`` uint8 image rescaled and normalized in bfloat16 (transformers' order of operations)
        -> ``(3, H, W)``."""
        import torch

        s, x = self.settings, pixels[0]
        if s.do_rescale and s.do_normalize:
            x = x.to(torch.bfloat16) * s.rescale_factor
            mean = torch.tensor(s.image_mean, dtype=x.dtype).view(-1, 1, 1)
            std = torch.tensor(s.image_std, dtype=x.dtype).view(-1, 1, 1)
            return x.sub_(mean).div_(std)
        return x * s.rescale_factor if s.do_rescale else x.float()
