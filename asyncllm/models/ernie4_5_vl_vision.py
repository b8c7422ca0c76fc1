"""The image encoder of ERNIE 4.5 VL (``Ernie4_5_VLMoeForConditionalGeneration``): transformers'
``vision_model`` (a Qwen2-VL-style ViT) and ``resampler_model`` (the projector into the decoder's width).

- **Patches** arrive as Qwen2-VL's do (asyncllm/models/qwen_vision.py: ``t x h x w`` patches, each
  ``spatial_merge_size ** 2`` consecutive ones a merge unit), but with no temporal patch for images: a patch
  is ``C x 14 x 14`` pixels and ``patch_embed.proj`` a plain bias-free linear map of it.
- **Blocks**: Qwen2-VL's (LayerNorm, fused biased ``qkv``, the same 2-D rotary: a quarter of each head's angles
  from the row, a quarter from the column; an ``fc1`` / ``fc2`` MLP of ``intermediate_size``), norms at
  ``rms_norm_eps``; then ``ln``, a LayerNorm over every patch.
- **Resampler**: each merge unit's patches concatenated (``spatial_linear``: fc1, exact GELU, fc2, LayerNorm);
  then the temporal merge: a unit next to the same unit of the following frame (``temporal_linear`` over the
  pair, even frames first; an image, one frame, is paired with itself), then ``mlp`` to the decoder's width and
  ``after_norm`` (RMSNorm at the decoder's eps).

The blocks split over the tensor-parallel ranks as Qwen2-VL's; the resampler is whole on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.clip import check_encoder_split
from asyncllm.models.layers import RMSNorm, TensorParallel
from asyncllm.models.qwen_vision import (
    QwenVisionBlock,
    _Widths,
    patch_layout,
    vision_rotary,
)

__all__ = ["ErnieResampler", "ErnieVisionTower"]


class ErnieVisionTower(nn.Module):
    """Pixels ``[patches, C * patch * patch]`` of images of ``(t, h, w)`` patches -> ``[patches, width]``."""

    def __init__(self, vision_config: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = vision_config
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise NotBuiltError("vision_config.rope_parameters", rope, "a vision rotary embedding other than 'axial'")
        widths = _Widths(False, cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size)
        check_encoder_split(tp.size, {"vision_config.num_heads": cfg.num_heads,
                                      "vision_config.intermediate_size": cfg.intermediate_size})
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.merge = int(cfg.spatial_merge_size)
        patch = cfg.in_channels * cfg.patch_size**2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch, cfg.hidden_size, bias=False, dtype=dtype)
        self.blocks = nn.ModuleList(QwenVisionBlock(cfg, widths, tp, dtype) for _ in range(cfg.depth))
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        for block in self.blocks:
            block.norm1.eps = block.norm2.eps = cfg.rms_norm_eps

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        layout = patch_layout(grid_thw, self.merge, None, pixel_values.device)
        if pixel_values.shape[0] != layout.num_patches:
            raise ValueError(f"{pixel_values.shape[0]} patches of pixels for grids {list(grid_thw)}")
        weight = self.patch_embed.proj.weight
        hidden = self.patch_embed.proj(pixel_values.to(weight.dtype))
        cos, sin = vision_rotary(layout.positions, self.head_dim, self.rope_theta)
        for block in self.blocks:
            hidden = block(hidden, cos, sin, layout.frames)
        return self.ln(hidden)


def _resampler_mlp(width_in: int, width_out: int, eps: float, dtype: torch.dtype) -> nn.Sequential:
    """``ln(fc2(gelu(fc1(x))))``, numbered as the checkpoint's (0, 2, 3)."""
    return nn.Sequential(nn.Linear(width_in, width_out, dtype=dtype), nn.GELU(),
                         nn.Linear(width_out, width_out, dtype=dtype), nn.LayerNorm(width_out, eps=eps, dtype=dtype))


class ErnieResampler(nn.Module):
    """The tower's patches of images of ``(t, h, w)`` -> one decoder-width row per merge unit (and frame pair)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision, text = hf_config.vision_config, hf_config.text_config
        self.merge = int(vision.spatial_merge_size)
        if int(vision.temporal_merge_size) != 2:  # transformers' pairing is written for two frames
            raise NotBuiltError("vision_config.temporal_merge_size", vision.temporal_merge_size, "2")
        self.unit = vision.hidden_size * self.merge**2
        self.spatial_linear = _resampler_mlp(self.unit, self.unit, vision.rms_norm_eps, dtype)
        self.temporal_linear = _resampler_mlp(2 * self.unit, self.unit, vision.rms_norm_eps, dtype)
        self.mlp = nn.Linear(self.unit, text.hidden_size, dtype=dtype)
        self.after_norm = RMSNorm(text.hidden_size, text.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        units = self.spatial_linear(hidden.reshape(-1, self.unit))
        pairs, start = [], 0
        for t, h, w in grid_thw:
            frames = units[start : start + t * h * w // self.merge**2].view(t, -1, self.unit)
            start += frames.shape[0] * frames.shape[1]
            second = frames[1::2] if t > 1 else frames
            count = min(len(frames[0::2]), len(second))
            pairs.append(torch.cat([frames[0::2][:count], second[:count]], dim=-1).flatten(0, 1))
        return self.after_norm(self.mlp(self.temporal_linear(torch.cat(pairs))))
