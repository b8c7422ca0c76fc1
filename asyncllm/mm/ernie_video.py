"""ERNIE 4.5 VL's video processing without torchvision: frames -> ``(T, h, w, 3 * 14 * 14)`` patches.

transformers' ``Ernie4_5_VLMoeVideoProcessor`` exists only for torchvision (which the CPU machines cannot import
beside their torch build), so this follows it:

- **Timestamps** (`stamped_frames`): with ``draw_on_frames`` (its default) each frame gets its time in the
  original video (``frames_indices[i] / fps``) written into its top left corner as ``time: HH:MM:SS.ss``, black
  with a white outline, in the checkpoint's ``font`` (a TrueType file saved beside the config) at a tenth of the
  frame's shorter side, by PIL as its processor draws it; frames under 10 pixels on that side are an
  `InvalidRequestError` (a font size of 0, which PIL refuses). No timestamp text enters the prompt.
- **Frames**: an odd count is made even by repeating the last (stamped) frame; every frame resized to one size, a
  multiple of 28 pixels within the ``size`` bounds (per frame: Qwen2-VL's ``smart_resize``), rescaled and
  normalized as its torchvision backend does (asyncllm/mm/glm4v_video.py's `torch_frames`).
- **Patches**: 14 x 14 per frame in Qwen's merge-unit order, with no temporal patch (asyncllm/mm/qwen_video.py's
  `video_patches` at ``temporal_patch_size`` 1): the grid is ``(frames, h, w)``. The model pairs consecutive
  frames in its resampler (``temporal_patch_size`` 2 is how many frames one placeholder covers).

The frames are used as given (the processor's ``do_sample_frames`` is not built, as for every model:
asyncllm/mm/videos.py). The settings are the checkpoint's video processor config (asyncllm/mm/qwen_video.py's
`video_processor_dict`) over the class' defaults; one not followed is a `NotBuiltError`. A checkpoint that draws
timestamps without its font file refuses its video requests naming it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.mm.image_ops import BICUBIC
from asyncllm.mm.qwen_video import (
    CLIP_MEAN,
    CLIP_STD,
    VideoSettings,
    frame_size,
    load_video_settings,
    video_patches,
    video_processor_dict,
)
from asyncllm.mm.videos import Video

__all__ = ["ERNIE_VIDEO_SETTINGS", "ErnieVideoProcessing", "ErnieVideoSettings", "stamped_frames", "timestamp_text"]

ERNIE_VIDEO_SETTINGS = VideoSettings(299 * 28 * 28, 1196 * 28 * 28, 14, 1, 2, CLIP_MEAN, CLIP_STD, torch_pixels=True)
"""``Ernie4_5_VLMoeVideoProcessor``'s defaults, its patches cut one frame deep (``temporal_patch_size`` 1)."""

_DEFAULT_FONT = "Roboto-Regular.ttf"
_FONT_SCALE = 0.1
"""A timestamp's font size over its frame's shorter side, and its outline's over its font size: transformers'
``size_factor``, the one argument ``_render_image_with_timestamp`` scales both by."""
_MIN_STAMPED_SIDE = 10
"""The shortest side a frame may have where timestamps are drawn: shorter ones get a font size of 0, which PIL (and
so transformers' processor) refuses. Without timestamps no side is too short (``smart_resize`` upscales)."""


@dataclass(frozen=True)
class ErnieVideoSettings:
    """The frames' resize, normalization and patch cut, and the font their timestamps are drawn in."""

    frames: VideoSettings = ERNIE_VIDEO_SETTINGS
    font: Path | None = None
    """The TrueType file timestamps are drawn in; None: ``draw_on_frames`` is off."""


def load_ernie_video_settings(model_path: str, hf_config: Any) -> ErnieVideoSettings:
    """The checkpoint's video processor settings (its class' defaults where it names none)."""
    config = video_processor_dict(model_path)
    if config.get("temporal_patch_size", 2) != 2:  # transformers' processor refuses any other
        raise NotBuiltError("video processor temporal_patch_size", config["temporal_patch_size"], "2")
    if config.get("resample", BICUBIC) != BICUBIC:
        raise NotBuiltError("video processor resample", config["resample"], "bicubic (3)")
    frames = dataclasses.replace(load_video_settings(model_path, ERNIE_VIDEO_SETTINGS), temporal_patch_size=1)
    draws = config.get("draw_on_frames", True)
    return ErnieVideoSettings(frames, Path(model_path) / (config.get("font") or _DEFAULT_FONT) if draws else None)


def ernie_video_grid(video: Video, settings: ErnieVideoSettings, field: str) -> tuple[int, int, int]:
    """(frames made even, height, width) in patches, from the video's frame count and size alone."""
    count, height, width = video.frames.shape[:3]
    _check_stampable(video, settings, field)
    h, w = frame_size(settings.frames, count, height, width, field)
    return count + count % 2, h // settings.frames.patch_size, w // settings.frames.patch_size


def ernie_video_patches(video: Video, settings: ErnieVideoSettings, field: str) -> np.ndarray:
    """The processor's pixel values, ``(frames made even, h, w, 3 * 14 * 14)`` float32."""
    frames = video.frames
    if settings.font is not None:
        if not settings.font.is_file():
            raise InvalidRequestError(field, f"this checkpoint's video processor draws timestamps on the frames in "
                                             f"{settings.font.name}, which is not beside its config")
        _check_stampable(video, settings, field)
        frames = stamped_frames(video, str(settings.font))
    if len(frames) % 2:
        frames = np.concatenate([frames, frames[-1:]])
    return video_patches(dataclasses.replace(video, frames=frames), settings.frames, field)


def _check_stampable(video: Video, settings: ErnieVideoSettings, field: str) -> None:
    """`InvalidRequestError` for frames too small for their timestamps (`_MIN_STAMPED_SIDE`)."""
    height, width = video.frames.shape[1:3]
    if settings.font is not None and min(height, width) < _MIN_STAMPED_SIDE:
        raise InvalidRequestError(field, f"the frames are {width} x {height}: this checkpoint's video processor draws "
                                         f"timestamps on them, which needs at least {_MIN_STAMPED_SIDE} pixels on the "
                                         f"shorter side")


def timestamp_text(seconds: float) -> str:
    """transformers' ``_convert_timestamp``: ``time: HH:MM:SS.ss``."""
    hours, seconds = seconds // 3600, seconds % 3600
    minutes, seconds = seconds // 60, seconds % 60
    return f"time: {int(hours):02d}:{int(minutes):02d}:{seconds:05.02f}"


@functools.lru_cache(maxsize=16)
def _font(path: str, size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.truetype(path, size)


def stamped_frames(video: Video, font: str) -> np.ndarray:
    """The frames with each one's timestamp drawn as ``_render_image_with_timestamp`` draws it."""
    from PIL import Image, ImageDraw

    out = []
    for frame, index in zip(video.frames, video.frames_indices):
        image = Image.fromarray(frame)
        size = int(min(*image.size) * _FONT_SCALE)
        ImageDraw.Draw(image).text((0, 0), timestamp_text(index / video.fps), font=_font(font, size), fill=(0, 0, 0),
                                   stroke_width=int(size * _FONT_SCALE), stroke_fill=(255, 255, 255))
        out.append(np.asarray(image))
    return np.stack(out)


class ErnieVideoProcessing:
    """The host processor's video hooks for ERNIE 4.5 VL (the model's ``mm_video_processing``)."""

    load = staticmethod(load_ernie_video_settings)
    grid = staticmethod(ernie_video_grid)
    patches = staticmethod(ernie_video_patches)
