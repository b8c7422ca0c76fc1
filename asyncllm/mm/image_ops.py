"""The image steps that transformers' torchvision-only ("fast") processors run, in torch alone: the CPU machines cannot
import torchvision beside their torch build, so the models whose processors need it (LFM2-VL:
asyncllm/mm/lfm2_vl_images.py; Llama 4: asyncllm/mm/llama4_images.py) process images with these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_json", "resize_like_torchvision"]


def resize_like_torchvision(pixels: Any, height: int, width: int) -> Any:
    """torchvision's antialiased bilinear resize of a ``(1, 3, H, W)`` uint8 CPU tensor: torch's own kernel, on the
    uint8 image where the CPU reports AVX2 (torchvision's native path there) and in float32 rounded back elsewhere."""
    import torch
    import torch.nn.functional as F

    if tuple(pixels.shape[-2:]) == (height, width):
        return pixels
    if "AVX2" in torch.backends.cpu.get_cpu_capability():  # torchvision resizes uint8 natively there
        return F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    out = F.interpolate(pixels.to(torch.float32), size=(height, width), mode="bilinear", align_corners=False,
                        antialias=True)
    return out.round_().to(torch.uint8)


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON settings file, or {} when it has none."""
    return json.loads(path.read_text()) if path.is_file() else {}
