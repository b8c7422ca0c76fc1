"""GLM-4.1V / GLM-4.5V video processing without torchvision: the settings, the pixels, each frame's timestamp.

transformers' ``Glm4vVideoProcessor`` exists only for torchvision, which the CPU machines cannot import beside
their torch build, so this follows it in torch:

- **Size**: every frame resized to one size, a multiple of ``patch_size * merge_size`` (28) whose pixels over all
  the frames lie within the ``size`` bounds (``shortest_edge`` / ``longest_edge`` are pixel counts): its
  ``smart_resize`` is Qwen3-VL's (asyncllm/mm/qwen_video.py's `frame_size` with ``pixels_over_frames``), which
  also refuses a video of fewer frames than ``temporal_patch_size``.
- **Pixels** (`torch_frames`): torchvision's antialiased bicubic resize of the ``[T, 3, H, W]`` uint8 CPU tensor,
  which torchvision hands to torch's own uint8 kernel, then transformers' fused rescale and normalize in float32
  (``(x - mean / rescale) / (std / rescale)``), both asyncllm/mm/image_ops.py's, so the pixels equal its processor's
  on the same machine (tests/unit/test_glm4v_video_pixels.py runs transformers' class with torchvision's two
  functions stood in). The patches are then cut as Qwen's (`asyncllm.mm.qwen_video.video_patches`).
- **Timestamps** (`frame_seconds`): ``Glm4vProcessor`` writes each temporal patch as
  ``<|begin_of_image|>``, its ``<|image|>`` placeholders, ``<|end_of_image|>`` and the whole seconds of the
  patch's first frame (``int(frames_indices[i] / fps)``); asyncllm/models/glm4v.py builds the pieces.

The processor's own frame sampling (``do_sample_frames``: 2 fps up to ``max_duration``) is not built: the frames
are used as given, as for every model (asyncllm/mm/videos.py).
"""

from __future__ import annotations

import numpy as np

from asyncllm.mm.image_ops import normalize_like_torchvision, resize_like_torchvision
from asyncllm.mm.qwen_video import CLIP_MEAN, CLIP_STD, VideoSettings
from asyncllm.mm.videos import Video

__all__ = ["GLM4V_VIDEO_SETTINGS", "frame_seconds", "torch_frames"]

GLM4V_VIDEO_SETTINGS = VideoSettings(112 * 112, 28 * 28 * 2 * 30000, 14, 2, 2, CLIP_MEAN, CLIP_STD,
                                     pixels_over_frames=True, torch_pixels=True)
"""``Glm4vVideoProcessor``'s defaults (the checkpoint's config overrides them)."""


def torch_frames(frames: np.ndarray, settings: VideoSettings, height: int, width: int) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 frames -> ``[T, 3, height, width]`` float32, resized and normalized as transformers'
    torchvision processors do on CPU."""
    import torch

    pixels = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    return normalize_like_torchvision(resize_like_torchvision(pixels, height, width, mode="bicubic"), settings).numpy()


def frame_seconds(video: Video, temporal_patch_size: int, num_patches: int) -> list[int]:
    """Each temporal patch's timestamp as ``Glm4vProcessor`` writes it: its first frame's whole seconds (the last
    repeated where the frames were padded)."""
    seconds = [int(index / video.fps) for index in video.frames_indices[::temporal_patch_size]][:num_patches]
    return seconds + [seconds[-1]] * (num_patches - len(seconds))
