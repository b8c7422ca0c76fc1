"""Qwen-VL video processing without torchvision: frames -> patches, and a video's placeholder tokens.

transformers' Qwen video processors need torchvision, so this follows them in
numpy and PIL: every frame resized to one size that is a multiple of
``patch_size * merge_size`` within the pixel bounds (`frame_size`: per frame for
Qwen2-VL and Qwen2.5-VL; over all the frames for Qwen3-VL), rescaled,
normalized, the frame count padded to a multiple of ``temporal_patch_size`` by
repeating the last frame, then cut into ``temporal_patch_size x patch_size x
patch_size`` patches in the processor's order (`video_patches`). PIL's bicubic
resize stands in for torchvision's: the pixels differ slightly from
transformers' processor where a frame is resized, the patch layout and counts
do not.

The settings are the checkpoint's video processor config, found where
transformers looks (``processor_config.json``'s ``video_processor``, then
``video_preprocessor_config.json``, then ``preprocessor_config.json``), over the
processor class' defaults (`VideoSettings`).

How a video enters the prompt is the model's (`VideoPiece`): Qwen2-VL and
Qwen2.5-VL replace its ``<|video_pad|>`` by one run of placeholders (one item,
its temporal patches spaced on M-RoPE's time axis); Qwen3-VL by a run per
temporal patch, each after its timestamp text (``<1.5 seconds>``) and between
vision start and end tokens (one item per temporal patch).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.mm.images import check_aspect_ratio
from asyncllm.mm.videos import Video

__all__ = ["VideoPiece", "VideoSettings", "frame_size", "frame_timestamps", "load_video_settings",
           "video_grid", "video_patches", "video_processor_dict"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoSettings:
    """A Qwen video processor's settings (the defaults: Qwen2-VL's ``Qwen2VLVideoProcessor``)."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    pixels_over_frames: bool = False
    """Qwen3-VL: the pixel bounds are of all frames together (``t x h x w``), not of each frame."""
    torch_pixels: bool = False
    """GLM-4.1V: frames resized and normalized as its torchvision processor does (asyncllm/mm/glm4v_video.py)."""
    do_rescale = do_normalize = True  # read by `normalize_like_torchvision`; not fields: the loader refuses them off


QWEN3_VIDEO_SETTINGS = VideoSettings(128 * 32 * 32, 768 * 32 * 32, 16, 2, 2, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5),
                                     pixels_over_frames=True)
"""``Qwen3VLVideoProcessor``'s defaults."""


@dataclass(frozen=True)
class VideoPiece:
    """One item of a video in the prompt: ``before`` tokens, the placeholders of temporal patches
    ``frames`` (a slice of the video's grid), ``after`` tokens."""

    before: list[int]
    frames: slice
    after: list[int]
    time_interval: float = 1.0
    """M-RoPE time positions per temporal patch (`asyncllm.protocol.MultiModalItem.time_interval`)."""


def video_processor_dict(model_path: str) -> dict[str, Any]:
    """The checkpoint's video processor config (``{}``: none; its class' defaults hold)."""
    folder = Path(model_path)
    processor = folder / "processor_config.json"
    if processor.is_file():
        nested = json.loads(processor.read_text()).get("video_processor")
        if isinstance(nested, dict):
            return nested
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    return {}


def load_video_settings(model_path: str, defaults: VideoSettings) -> VideoSettings:
    """The checkpoint's video processor settings over ``defaults`` (its class' own); settings this module does not
    follow are refused by name."""
    config = video_processor_dict(model_path)
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if config.get(flag) is False:
            raise NotBuiltError(f"video processor {flag}", False, "videos resized, rescaled and normalized")
    if config.get("cap_pixels_per_frame"):
        raise NotBuiltError("video processor cap_pixels_per_frame", True, "the per-frame pixel cap for videos")
    size = config.get("size") or {}
    values = {
        "min_pixels": config.get("min_pixels", size.get("shortest_edge")),
        "max_pixels": config.get("max_pixels", size.get("longest_edge")),
        **{key: config.get(key) for key in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor")},
        "image_mean": tuple(config["image_mean"]) if config.get("image_mean") else None,
        "image_std": tuple(config["image_std"]) if config.get("image_std") else None,
    }
    return dataclasses.replace(defaults, **{key: value for key, value in values.items() if value is not None})


def frame_size(settings: VideoSettings, num_frames: int, height: int, width: int, field: str) -> tuple[int, int]:
    """The (height, width) every frame is resized to: transformers' ``smart_resize`` of the model's video
    processor (Qwen3-VL's bounds the pixels of all the frames)."""
    factor = settings.patch_size * settings.merge_size
    frames = 1
    check_aspect_ratio(height, width, field, "a video frame")  # before the upscale below divides by a side
    if settings.pixels_over_frames:
        if num_frames < settings.temporal_patch_size:
            raise InvalidRequestError(field, f"{num_frames} frame(s): this model's videos need at least "
                                             f"{settings.temporal_patch_size}")
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        frames = num_frames
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / settings.temporal_patch_size) * settings.temporal_patch_size if frames > 1 else 1
    if t_bar * h_bar * w_bar > settings.max_pixels:
        beta = math.sqrt(frames * height * width / settings.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_grid(video: Video, settings: VideoSettings, field: str) -> tuple[int, int, int]:
    """The video's (temporal, height, width) patch grid, from its frame count and size alone."""
    count, height, width = video.frames.shape[:3]
    h, w = frame_size(settings, count, height, width, field)
    return -(-count // settings.temporal_patch_size), h // settings.patch_size, w // settings.patch_size


def video_patches(video: Video, settings: VideoSettings, field: str) -> np.ndarray:
    """The processor's pixel values ``(t, h, w, 3 * temporal_patch_size * patch_size**2)`` float32."""
    from PIL import Image

    count, height, width = video.frames.shape[:3]
    new_h, new_w = frame_size(settings, count, height, width, field)
    if settings.torch_pixels:
        from asyncllm.mm.glm4v_video import torch_frames

        pixels = torch_frames(video.frames, settings, new_h, new_w)  # [T, C, H, W]
    else:
        frames = [f if (height, width) == (new_h, new_w) else
                  np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.Resampling.BICUBIC)) for f in video.frames]
        mean = np.asarray(settings.image_mean, dtype=np.float32)
        std = np.asarray(settings.image_std, dtype=np.float32)
        pixels = (np.stack(frames).astype(np.float32) * np.float32(settings.rescale_factor) - mean) / std
        pixels = pixels.transpose(0, 3, 1, 2)  # [T, C, H, W]
    tps, ps, m = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    if pad := -count % tps:
        pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
    gt, gh, gw = pixels.shape[0] // tps, new_h // ps, new_w // ps
    patches = pixels.reshape(gt, tps, 3, gh // m, m, ps, gw // m, m, ps).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(gt, gh, gw, 3 * tps * ps * ps), dtype=np.float32)


def frame_timestamps(video: Video, temporal_patch_size: int) -> list[float]:
    """Each temporal patch's time in seconds (Qwen3-VL's processor: the mean of its first and last frame's)."""
    indices = list(video.frames_indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [index / video.fps for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)]
