"""LLaVA-NeXT-Video's video processing without torchvision: frames -> one item of ``[1, T, 3, H, W]`` pixels.

transformers' ``LlavaNextVideoVideoProcessor`` exists only for torchvision (which the CPU machines cannot import
beside their torch build), so this follows it in torch, as asyncllm/mm/glm4v_video.py does GLM-4.1V's:

- **Size**: every frame's shorter side resized to ``size["shortest_edge"]`` (the longer one in proportion, rounded
  down: transformers' ``get_resize_output_image_size``; or to ``size``'s ``height`` x ``width``), by torchvision's
  antialiased bicubic resize of the uint8 tensor, which is torch's own uint8 kernel on CPU
  (asyncllm/mm/image_ops.py's `resize_like_torchvision`). Frames of an aspect ratio over 200 are an
  `InvalidRequestError` before any resize, as the Qwen-VL models' (a 2 x 4000 frame would become 224 x 448000).
- **Crop**: the middle ``crop_size`` (zero padding first where a side is short, as torchvision pads).
- **Pixels**: transformers' fused rescale and normalize in float32 (``(x - mean / rescale) / (std / rescale)``:
  `normalize_like_torchvision`).

The frames are used as given (the processor's ``do_sample_frames`` is not built, as for every model:
asyncllm/mm/videos.py). The settings are the checkpoint's video processor config (found where transformers
looks: asyncllm/mm/qwen_video.py's `video_processor_dict`) over the class' defaults; a setting this module does
not follow (no resize, no crop, another resample) is a `NotBuiltError`. A video is one item (LLaVA-NeXT-Video's
``<video>`` becomes one run of placeholders: asyncllm/models/llava_next_video.py); its array's leading axis of 1
tells it from an image's tiles (transformers' ``pixel_values_videos`` layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.errors import NotBuiltError
from asyncllm.mm.image_ops import BICUBIC, normalize_like_torchvision, resize_like_torchvision
from asyncllm.mm.images import check_aspect_ratio
from asyncllm.mm.qwen_video import CLIP_MEAN, CLIP_STD, video_processor_dict
from asyncllm.mm.videos import Video

__all__ = ["LlavaVideoProcessing", "LlavaVideoSettings", "llava_video_pixels", "load_llava_video_settings"]


@dataclass(frozen=True)
class LlavaVideoSettings:
    """``LlavaNextVideoVideoProcessor``'s settings (its defaults)."""

    shortest_edge: int | None = 224
    """The shorter side's length after the resize; None: ``size`` is exact (``height`` x ``width``)."""
    size: tuple[int, int] = (224, 224)
    """(height, width) of an exact resize (``shortest_edge`` None)."""
    crop_size: tuple[int, int] = (224, 224)
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale = do_normalize = True  # read by `normalize_like_torchvision`; not fields: the loader refuses them off


def load_llava_video_settings(model_path: str, hf_config: Any) -> LlavaVideoSettings:
    """The checkpoint's video processor settings; the ones not followed, and a crop other than the tower's input
    size (its CLIP tower takes no other), are refused by name."""
    config = video_processor_dict(model_path)
    for flag in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb"):
        if config.get(flag) is False:
            raise NotBuiltError(f"video processor {flag}", False, "LLaVA-NeXT-Video's videos resized, cropped, "
                                                                  "rescaled and normalized")
    if config.get("resample", BICUBIC) != BICUBIC:
        raise NotBuiltError("video processor resample", config["resample"], "bicubic (3)")
    size = config.get("size") or {"shortest_edge": 224}
    crop = config.get("crop_size") or {"height": 224, "width": 224}
    settings = LlavaVideoSettings(
        size.get("shortest_edge"), (size.get("height", 0), size.get("width", 0)), (crop["height"], crop["width"]),
        tuple(config.get("image_mean") or CLIP_MEAN), tuple(config.get("image_std") or CLIP_STD),
        float(config.get("rescale_factor", 1 / 255)))
    tower = hf_config.vision_config.image_size
    if settings.crop_size != (tower, tower):
        raise NotBuiltError("video processor crop_size", crop, f"the vision tower's {tower}x{tower} input")
    return settings


def resized_size(settings: LlavaVideoSettings, height: int, width: int) -> tuple[int, int]:
    """(height, width) a frame is resized to (transformers' ``get_resize_output_image_size``, not to square)."""
    if settings.shortest_edge is None:
        return settings.size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(settings.shortest_edge * long / short)
    return (new_long, settings.shortest_edge) if width <= height else (settings.shortest_edge, new_long)


def llava_video_pixels(video: Video, settings: LlavaVideoSettings, field: str) -> np.ndarray:
    """``[1, T, 3, crop height, crop width]`` float32: the processor's ``pixel_values_videos`` of one video; frames
    of an aspect ratio over 200 are refused before any resize (as the Qwen-VL models')."""
    import torch

    check_aspect_ratio(*video.frames.shape[1:3], field, "a video frame")
    pixels = torch.from_numpy(np.ascontiguousarray(video.frames)).permute(0, 3, 1, 2).contiguous()
    pixels = resize_like_torchvision(pixels, *resized_size(settings, *pixels.shape[-2:]), mode="bicubic")
    return normalize_like_torchvision(_center_crop(pixels, *settings.crop_size), settings).numpy()[None]


def _center_crop(pixels: Any, height: int, width: int) -> Any:
    """transformers' torchvision ``center_crop``: zero-padded (left/top the smaller half) where a side is short."""
    import torch.nn.functional as F

    pad_h, pad_w = max(height - pixels.shape[-2], 0), max(width - pixels.shape[-1], 0)
    if pad_h or pad_w:
        pixels = F.pad(pixels, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
    top, left = int((pixels.shape[-2] - height) / 2.0), int((pixels.shape[-1] - width) / 2.0)
    return pixels[..., top:top + height, left:left + width]


def llava_video_grid(video: Video, settings: LlavaVideoSettings, field: str) -> tuple[int, int, int]:
    """(frames, height, width) of the video's pixels, from its frame count alone (frames of an aspect ratio over 200
    refused)."""
    check_aspect_ratio(*video.frames.shape[1:3], field, "a video frame")
    return video.frames.shape[0], *settings.crop_size


class LlavaVideoProcessing:
    """The host processor's video hooks for LLaVA-NeXT-Video (the model's ``mm_video_processing``; the Qwen-VL
    models' are asyncllm/mm/qwen_video.py's)."""

    load = staticmethod(load_llava_video_settings)
    grid = staticmethod(llava_video_grid)
    patches = staticmethod(llava_video_pixels)
