"""Command A Vision's image processing without torchvision: an image -> its tiles (and thumbnail).

transformers' ``Cohere2VisionImageProcessor`` exists only for torchvision, which the CPU machines cannot import beside
their torch build, so this follows it step for step in torch (`Cohere2VisionImages`, loaded from the checkpoint's
``preprocessor_config.json`` in place of ``AutoImageProcessor``):

- `tile_grid`: among the grids of at most ``max_patches`` tiles of ``size`` pixels (ordered by tile count), the one
  the image fits with the least upscaling, or, when every grid downscales it, the least downscaling; the first one
  wins a tie. ``min_patches`` changes nothing, as in transformers.
- With ``crop_to_patches`` (the default) the image is resized to that grid and cut row by row; a grid of several tiles
  is followed by a thumbnail of the whole image resized to one tile. Without it the image is one resized tile.
- Rescale and normalize in float32 (transformers' fused form).

The resize is torchvision's antialiased bicubic on the uint8 CPU tensor (torch's own kernel, which torchvision runs
natively for uint8 bicubic), so the pixels equal transformers' processor's on the same machine
(tests/unit/test_cohere2_vision_images.py runs it with torchvision's resize stood in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.image_ops import BICUBIC, TorchImageProcessor, normalize_like_torchvision, resize_like_torchvision

__all__ = ["Cohere2VisionImageSettings", "Cohere2VisionImages", "tile_grid"]


@dataclass(frozen=True)
class Cohere2VisionImageSettings:
    """``Cohere2VisionImageProcessor``'s settings (its defaults)."""

    size: tuple[int, int] = (512, 512)
    """(height, width) of one tile; square."""
    crop_to_patches: bool = True
    min_patches: int = 1
    max_patches: int = 12
    patch_size: int = 16
    """Tokens per side of a tile (after the pixel shuffle): ``Cohere2VisionProcessor`` writes its square per tile.
    The model counts them from its config; asyncllm/models/cohere2_vision.py's ``mm_check_image_processor`` refuses
    a checkpoint (or request) whose value disagrees."""
    resample: int = BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    do_convert_rgb: bool = True


def tile_grid(height: int, width: int, tile: int, max_patches: int) -> tuple[int, int]:
    """(columns, rows) of the grid of at most ``max_patches`` tiles that ``height x width`` fits best
    (transformers' ``get_optimal_tiled_canvas``)."""
    grids = sorted(((w, h) for w in range(1, max_patches + 1) for h in range(1, max_patches + 1)
                    if w * h <= max_patches), key=lambda grid: grid[0] * grid[1])
    scales = [min(w * tile / width, h * tile / height) for w, h in grids]
    if all(scale < 1 for scale in scales):
        return grids[scales.index(max(scales))]
    upscales = [scale if scale >= 1.0 else 10e9 for scale in scales]
    return grids[upscales.index(min(upscales))]


class Cohere2VisionImages(TorchImageProcessor):
    """``Cohere2VisionImageProcessor`` in torch (`TorchImageProcessor`: ``from_pretrained``, ``to_dict``, a call):
    one image -> ``(tiles, 3, S, S)`` float32, the thumbnail last when there are several tiles."""

    settings_cls = Cohere2VisionImageSettings

    def __init__(self, settings: Cohere2VisionImageSettings) -> None:
        if settings.resample != BICUBIC:
            raise NotBuiltError("resample", settings.resample, "Command A Vision resizing other than bicubic (3)")
        if not settings.do_resize and not settings.crop_to_patches:  # cropping resizes to the grid either way
            raise NotBuiltError("do_resize", False, "Command A Vision tiles of the image's own size")
        if settings.size[0] != settings.size[1]:
            raise ConfigError("size", settings.size, "a square tile (height == width)")
        if settings.max_patches < 1:
            raise ConfigError("max_patches", settings.max_patches, "at least 1")
        super().__init__(settings)

    def process(self, image: Any) -> np.ndarray:
        import torch

        s, tile = self.settings, self.settings.size[0]
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)[None]
        if not s.crop_to_patches:
            return normalize_like_torchvision(self._resized(pixels, tile, tile), s).numpy()
        cols, rows = tile_grid(*pixels.shape[-2:], tile, s.max_patches)
        whole = self._resized(pixels, rows * tile, cols * tile)
        tiles = [whole[..., r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
        if len(tiles) > 1:
            tiles.append(self._resized(pixels, tile, tile))
        return normalize_like_torchvision(torch.cat(tiles), s).numpy()

    @staticmethod
    def _resized(pixels: Any, height: int, width: int) -> Any:
        return resize_like_torchvision(pixels, height, width, mode="bicubic")
