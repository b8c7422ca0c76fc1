"""LFM2-VL's image processing without torchvision: an image -> its tiles' patches and the layout of its tokens.

transformers' ``Lfm2VlImageProcessor`` exists only for torchvision, which the CPU machines cannot import beside their
torch build, so this follows it step for step in torch (`Lfm2VlImages`, loaded from the checkpoint's
``preprocessor_config.json`` in place of ``AutoImageProcessor``):

- `smart_size`: the image's size rounded to multiples of ``encoder_patch_size * downsample_factor`` with between
  ``min_image_tokens`` and ``max_image_tokens`` tokens, the aspect ratio kept as closely as those allow.
- An image over ``max_pixels_tolerance`` times the token budget (`too_large`) is split (unless ``min_tiles ==
  max_tiles == 1``): resized to a grid of ``tile_size`` tiles whose shape is the closest to its aspect ratio
  among ``min_tiles`` to ``max_tiles`` tiles (`tile_grid`), cut row by row, and followed by a thumbnail of the
  whole image at its smart size (``use_thumbnail``). Any other image is one tile at its smart size.
- Each tile: rescaled and normalized (transformers' fused form, in float32), cut into ``encoder_patch_size``
  patches, each patch's pixels row by row, channels last: ``(rows, cols, patch * patch * 3)``.

The resize is torchvision's on a CPU tensor (bilinear, antialiased): torch's own kernel, on the uint8 image where
the CPU reports AVX2 (torchvision's native path) and in float32 rounded back elsewhere, so the pixels equal
transformers' processor's on the same machine (tests/unit/test_lfm2_vl.py runs it with torchvision's resize
stood in).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.image_ops import BILINEAR, TorchImageProcessor, resize_like_torchvision

__all__ = ["Lfm2VlImage", "Lfm2VlImages", "TileArrays", "smart_size", "tile_grid", "too_large"]


@dataclass(frozen=True)
class Lfm2VlSettings:
    """``Lfm2VlImageProcessor``'s settings (its defaults) and its processor's ``use_image_special_tokens``."""

    downsample_factor: int = 2
    do_image_splitting: bool = True
    min_tiles: int = 2
    max_tiles: int = 10
    use_thumbnail: bool = True
    min_image_tokens: int = 64
    max_image_tokens: int = 256
    encoder_patch_size: int = 16
    tile_size: int = 512
    max_pixels_tolerance: float = 2.0
    resample: int = BILINEAR
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    use_image_special_tokens: bool = True
    """The processor's: ``<|image_start|>``, tile and thumbnail markers, ``<|image_end|>`` around the image tokens."""

    @property
    def unit(self) -> int:
        """Pixels per side of one token: a patch times the downsampling."""
        return self.encoder_patch_size * self.downsample_factor


def _round_to(value: float, factor: int) -> int:
    return round(value / factor) * factor


def smart_size(height: int, width: int, s: Lfm2VlSettings) -> tuple[int, int]:
    """(height, width) in multiples of `Lfm2VlSettings.unit` holding ``min_image_tokens`` to ``max_image_tokens``."""
    unit = s.unit
    low, high = s.min_image_tokens * unit * unit, s.max_image_tokens * unit * unit
    h, w = max(unit, _round_to(height, unit)), max(unit, _round_to(width, unit))
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h, w = max(unit, math.floor(height / beta / unit) * unit), max(unit, math.floor(width / beta / unit) * unit)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h, w = math.ceil(height * beta / unit) * unit, math.ceil(width * beta / unit) * unit
    return h, w


def too_large(height: int, width: int, s: Lfm2VlSettings) -> bool:
    """Whether the image is over ``max_pixels_tolerance`` times the pixels of ``max_image_tokens``."""
    h = max(s.encoder_patch_size, _round_to(height, s.unit))
    w = max(s.encoder_patch_size, _round_to(width, s.unit))
    return h * w > s.max_image_tokens * s.unit * s.unit * s.max_pixels_tolerance


def _grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """Every (cols, rows) of ``min_tiles`` to ``max_tiles`` tiles, fewest tiles first (the set built and sorted as
    transformers builds it, so that ties keep its order)."""
    grids = {(c, r) for n in range(min_tiles, max_tiles + 1) for c in range(1, n + 1) for r in range(1, n + 1)
             if min_tiles <= c * r <= max_tiles}
    return sorted(grids, key=lambda grid: grid[0] * grid[1])


def tile_grid(height: int, width: int, s: Lfm2VlSettings) -> tuple[int, int]:
    """(rows, cols) of tiles whose shape is closest to the image's aspect ratio; of equally close ones, the later
    (more tiles) while the image covers over half of its tiles' area."""
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for cols, rows in _grids(s.min_tiles, s.max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and height * width > 0.5 * s.tile_size * s.tile_size * cols * rows:
            best = (cols, rows)
    return best[1], best[0]


@dataclass
class Lfm2VlImage:
    """One processed image: its tiles (the thumbnail last) and the layout the processor writes tokens for."""

    tiles: list[np.ndarray]
    """Each ``(patch rows, patch cols, patch * patch * 3)`` float32."""
    rows: int
    cols: int
    thumbnail: bool
    """Whether the last tile is the whole image's thumbnail (a split image's, with ``use_thumbnail``)."""
    use_image_special_tokens: bool


class TileArrays(list):
    """One image's tile arrays; a slice of them (one item's) is the tile with a leading axis: ``(1, rows, cols, D)``."""

    def __getitem__(self, index: Any) -> Any:
        picked = super().__getitem__(index)
        return np.stack(picked) if isinstance(index, slice) else picked


class Lfm2VlImages(TorchImageProcessor):
    """``Lfm2VlImageProcessor`` in torch (`TorchImageProcessor`: ``from_pretrained``, ``to_dict``, a call)."""

    settings_cls = Lfm2VlSettings

    def __init__(self, settings: Lfm2VlSettings) -> None:
        if settings.resample != BILINEAR:
            raise NotBuiltError("resample", settings.resample, "LFM2-VL resizing other than bilinear (2)")
        if settings.do_image_splitting and settings.min_tiles > settings.max_tiles:
            raise ConfigError("min_tiles", settings.min_tiles, f"at most max_tiles ({settings.max_tiles})")
        super().__init__(settings)

    @classmethod
    def adjust(cls, values: dict[str, Any], processor: dict[str, Any]) -> None:
        """The processor's ``use_image_special_tokens`` beside the image processor's settings."""
        if "use_image_special_tokens" in processor:
            values["use_image_special_tokens"] = processor["use_image_special_tokens"]

    def process(self, image: Any) -> Lfm2VlImage:
        import torch

        s = self.settings
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
        height, width = pixels.shape[-2:]
        splitting = s.do_image_splitting and not s.min_tiles == s.max_tiles == 1
        small = smart_size(height, width, s)
        if splitting and too_large(height, width, s):
            rows, cols = tile_grid(height, width, s)
            whole = resize_like_torchvision(pixels, rows * s.tile_size, cols * s.tile_size)
            tiles = [whole[..., r * s.tile_size:(r + 1) * s.tile_size, c * s.tile_size:(c + 1) * s.tile_size]
                     for r in range(rows) for c in range(cols)]
            thumbnail = s.use_thumbnail and rows * cols != 1
            tiles += [resize_like_torchvision(pixels, *small)] if thumbnail else []
        else:
            rows = cols = 1
            tiles, thumbnail = [resize_like_torchvision(pixels, *small)], False
        return Lfm2VlImage(TileArrays(self._patches(tile) for tile in tiles), rows, cols, thumbnail,
                           s.use_image_special_tokens)

    def _patches(self, tile: Any) -> np.ndarray:
        """A ``(1, 3, H, W)`` uint8 tile -> its normalized patches ``(H / p, W / p, p * p * 3)``."""
        import torch

        s, p = self.settings, self.settings.encoder_patch_size
        x = tile[0].to(torch.float32)
        if s.do_normalize:
            scale = 1.0 / s.rescale_factor if s.do_rescale else 1.0  # transformers folds the rescale into mean / std
            mean = (torch.tensor(s.image_mean) * scale).view(-1, 1, 1)
            std = (torch.tensor(s.image_std) * scale).view(-1, 1, 1)
            x = (x - mean) / std
        elif s.do_rescale:
            x = x * s.rescale_factor
        channels, height, width = x.shape
        x = x.reshape(channels, height // p, p, width // p, p).permute(1, 3, 2, 4, 0)
        return x.reshape(height // p, width // p, p * p * channels).numpy()
