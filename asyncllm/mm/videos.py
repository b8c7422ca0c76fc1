"""Video inputs: decoded frames (and what the caller knows of their timing) -> a checked, hashable `Video`.

A video is given as its frames, already sampled: a ``[T, H, W, 3]`` uint8 array,
a list of frames (PIL images or ``[H, W, 3]`` uint8 arrays), or either of those
with vLLM's metadata dict, ``(frames, {"fps": ..., "frames_indices": [...],
"total_num_frames": ...})``. The frames are used as given (the engine samples
none); the metadata only sets their timing: Qwen2.5-VL spaces the frames on its
time axis by it and Qwen3-VL writes each frame's timestamp into the prompt
(transformers' defaults without it: 24 fps, the frames consecutive).

Encoded video files need a decoder: `decode_video_file` reads them with PyAV
(``pip install av``) when it is installed, else the request fails naming it.
Runs on the processor thread; bad input fails its own request with
`InvalidRequestError`.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.config_checks import is_int
from asyncllm.errors import InvalidRequestError
from asyncllm.mm.images import to_rgb
from asyncllm.mm.video_files import DEFAULT_NUM_FRAMES, decode_video_file

__all__ = ["DEFAULT_FPS", "MAX_FRAMES", "Video", "VideoInput", "is_one_video", "read_video"]

VideoInput = Any
"""Frames (``[T, H, W, 3]`` uint8 array or a list of frames), optionally as ``(frames, metadata dict)``, or an
encoded file (bytes, a path or a base64 ``data:video/...`` URL; decoded with PyAV)."""

DEFAULT_FPS = 24.0
"""transformers' frame rate of a video whose metadata gives none."""

MAX_FRAMES = 768
"""Most frames one video may have (the Qwen video processors' ``max_frames``)."""

_METADATA_KEYS = {"fps", "frames_indices", "total_num_frames", "duration", "video_backend", "do_sample_frames"}
"""vLLM's video metadata; ``duration`` and ``video_backend`` are informational."""


@dataclass(frozen=True, eq=False)
class Video:
    """A video's frames and their timing in the original video."""

    frames: np.ndarray
    """``[T, H, W, 3]`` uint8 RGB."""
    fps: float
    """The original video's frame rate."""
    frames_indices: tuple[int, ...]
    """Which frame of the original each of ``frames`` is."""
    total_num_frames: int

    @property
    def sampled_fps(self) -> float:
        """Frames per second of ``frames`` (transformers' ``VideoMetadata.sampled_fps``)."""
        return len(self.frames_indices) / self.total_num_frames * self.fps

    def key(self) -> str:
        """A content hash of the frames and their timing (the timing moves the model's positions)."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"video:{self.frames.shape}:{self.fps!r}:{self.total_num_frames}:".encode())
        digest.update(np.asarray(self.frames_indices, dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(self.frames).tobytes())
        return digest.hexdigest()


def is_one_video(value: Any) -> bool:
    """Whether vLLM's ``multi_modal_data["video"]`` value is one video (an array, a ``(frames, metadata)`` pair,
    a list of frames, an encoded file) rather than a list of videos."""
    if isinstance(value, (np.ndarray, bytes, bytearray, memoryview, str)) or _is_pair(value) or hasattr(value, "__fspath__"):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(_is_frame(f) for f in value)


def read_video(video: VideoInput, field: str, max_frame_pixels: int, num_frames: int = DEFAULT_NUM_FRAMES) -> Video:
    """The checked `Video`: ``max_frame_pixels`` (mm_max_image_pixels) bounds each frame, `MAX_FRAMES` their count;
    ``num_frames`` are sampled from an encoded file (``media_io_kwargs``)."""
    frames, metadata = (video[0], video[1]) if _is_pair(video) else (video, None)
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or hasattr(frames, "__fspath__"):
        frames, decoded_meta = decode_video_file(frames, field, max_frame_pixels, num_frames)
        metadata = {**decoded_meta, **(metadata or {})}
    array = _frames_array(frames, field, max_frame_pixels)
    return _with_timing(array, metadata, field)


def _is_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)


def _is_frame(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image) or isinstance(value, np.ndarray) and value.ndim == 3


def _frames_array(frames: Any, field: str, max_frame_pixels: int) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 from an array or a list of frames, every frame the same size."""
    from PIL import Image

    if isinstance(frames, (list, tuple)):
        if not frames:
            raise InvalidRequestError(field, "a video needs at least one frame")
        frames = [np.asarray(to_rgb(f)) if isinstance(f, Image.Image) else f for f in frames]
        if not all(isinstance(f, np.ndarray) for f in frames):
            raise InvalidRequestError(field, "a video's frames must be PIL images or [H, W, 3] uint8 arrays")
        if len({f.shape for f in frames}) != 1:
            raise InvalidRequestError(field, f"a video's frames must all have one size, got {sorted({f.shape for f in frames})}")
        frames = np.stack(frames)
    if not isinstance(frames, np.ndarray):
        raise InvalidRequestError(field, "a video must be a [T, H, W, 3] uint8 array, a list of frames, a "
                                         f"(frames, metadata) pair or an encoded file, got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise InvalidRequestError(field, f"a video array must be [T, H, W, 3] uint8 RGB with T >= 1, got "
                                         f"{list(frames.shape)} {frames.dtype}")
    count, height, width = frames.shape[:3]
    if height == 0 or width == 0:
        raise InvalidRequestError(field, f"the frames are {width}x{height}: a frame needs at least one pixel")
    if count > MAX_FRAMES:
        raise InvalidRequestError(field, f"{count} frames, over the {MAX_FRAMES} a video may have")
    if height * width > max_frame_pixels:
        raise InvalidRequestError(field, f"the frames are {width}x{height} = {width * height} pixels, over "
                                         f"mm_max_image_pixels={max_frame_pixels}")
    return frames


def _with_timing(frames: np.ndarray, metadata: dict[str, Any] | None, field: str) -> Video:
    """The `Video` of ``frames`` with vLLM's metadata checked (defaults: 24 fps, frames 0 .. T-1 of T)."""
    metadata = dict(metadata or {})
    unknown = set(metadata) - _METADATA_KEYS
    if unknown:
        raise InvalidRequestError(f"{field}.metadata", f"unknown keys {sorted(unknown)} (known: {sorted(_METADATA_KEYS)})")
    if metadata.get("do_sample_frames"):
        raise InvalidRequestError(f"{field}.metadata", "do_sample_frames=True: sampling frames is not built; "
                                                       "pass the frames to use")
    count = frames.shape[0]
    fps = metadata.get("fps")
    fps = DEFAULT_FPS if fps is None else fps
    if isinstance(fps, (bool, np.bool_)) or not isinstance(fps, numbers.Real) or not 0 < fps < math.inf:
        raise InvalidRequestError(f"{field}.metadata.fps", f"a finite frame rate > 0, got {fps!r}")
    indices = metadata.get("frames_indices")
    indices = list(range(count)) if indices is None else [int(i) if _is_index(i) else i for i in indices]
    if len(indices) != count or not all(is_int(i) and i >= 0 for i in indices):
        raise InvalidRequestError(f"{field}.metadata.frames_indices", f"one index >= 0 per frame ({count} frames)")
    total = metadata.get("total_num_frames")
    total = max(indices) + 1 if total is None else int(total) if _is_index(total) else total
    if not is_int(total) or total <= max(indices):
        raise InvalidRequestError(f"{field}.metadata.total_num_frames",
                                  f"an int above every frame index (largest {max(indices)}), got {total!r}")
    return Video(frames, float(fps), tuple(indices), total)


def _is_index(value: Any) -> bool:
    """An int or a numpy integer (vLLM's metadata may hold numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
