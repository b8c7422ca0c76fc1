"""The vision encoder of GLM-4.1V / GLM-4.5V (transformers' ``Glm4vVisionModel``, ``model.visual``).

Patches arrive as Qwen2-VL's do (asyncllm/models/qwen_vision.py: ``t x h x w`` patches of ``C x
temporal_patch x patch x patch`` pixels, each ``spatial_merge_size ** 2`` consecutive patches one merge
unit), and the tower reuses its patch layout, 2-D rotary and per-image attention. GLM's own parts:

- ``patch_embed.proj`` (a Conv3d with a bias, run as one matmul per patch), then ``post_conv_layernorm``
  (RMSNorm), then ``embeddings.position_embedding``: a learned ``side x side`` table (``side = image_size /
  patch_size``) resampled to each image's patch grid by bicubic ``grid_sample`` at the patch centres
  (corners not aligned, border padding), in float32 as transformers does, and added.
- ``blocks``: RMSNorm, attention (fused ``qkv`` with ``attention_bias``, ``proj`` without a bias, the 2-D
  rotary), RMSNorm, a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, no biases) of width
  ``out_hidden_size``.
- ``post_layernorm``; ``downsample``: a Conv2d whose kernel and stride are the merge size, one merge unit ->
  one ``out_hidden_size`` row; ``merger``: ``proj``, LayerNorm, GELU, then a gated MLP of width
  ``intermediate_size`` back to ``out_hidden_size`` (the decoder's width).

The tower is small next to the decoder, so it is whole on every rank (plain torch layers): with
``mm_encoder_tp_mode="data"`` the ranks split a step's images, with "weights" each encodes them all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.clip import activation
from asyncllm.models.layers import RMSNorm
from asyncllm.models.qwen_vision import QwenPatchEmbed, Segments, patch_layout, rotate_vision, vision_rotary

__all__ = ["Glm4vVisionTower", "interpolated_positions"]

_MODEL_TYPES = ("glm4v_vision", "glm4v_moe_vision")
"""GLM-4.1V's tower, and GLM-4.5V's (the same tower under its own name)."""


def interpolated_positions(table: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The ``[side * side, hidden]`` position table resampled bicubically at each patch ``[N, hidden]`` (float32):
    ``positions`` and ``sizes`` ``[N, 2]`` are the patch's (row, col) and its image's grid (h, w), in patches."""
    side = math.isqrt(table.shape[0])
    image = table.float().view(side, side, -1).permute(2, 0, 1)[None]  # [1, hidden, side, side]
    centres = (positions.float() + 0.5) / sizes.float() * 2 - 1  # (row, col) in [-1, 1]
    grid = centres.flip(-1)[None, :, None, :]  # grid_sample reads (x, y): (col, row)
    out = F.grid_sample(image, grid, mode="bicubic", align_corners=False, padding_mode="border")
    return out[0, :, :, 0].T


class _GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, width: int, features: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(act, "vision_config.hidden_act")
        self.gate_proj = nn.Linear(width, features, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(width, features, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(features, width, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Glm4vVisionAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=bool(cfg.attention_bias), dtype=dtype)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, images: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        return self.proj(images.attend(rotate_vision(q, cos, sin), rotate_vision(k, cos, sin), v).flatten(1))


class Glm4vVisionBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Glm4vVisionAttention(cfg, dtype)
        self.mlp = _GatedMLP(cfg.hidden_size, cfg.out_hidden_size, cfg.hidden_act, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, images: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, images)
        return x + self.mlp(self.norm2(x))


class Glm4vPatchMerger(nn.Module):
    """A downsampled unit -> the decoder's width: ``proj``, LayerNorm, GELU, a gated MLP."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width = cfg.out_hidden_size
        self.proj = nn.Linear(width, width, bias=False, dtype=dtype)
        self.post_projection_norm = nn.LayerNorm(width, dtype=dtype)
        self.act1 = nn.GELU()
        self.act_fn = activation(cfg.hidden_act, "vision_config.hidden_act")
        self.gate_proj = nn.Linear(width, cfg.intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(width, cfg.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, width, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.post_projection_norm(self.proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Glm4vVisionEmbeddings(nn.Module):
    """``position_embedding``: the learned table, resampled per image (`interpolated_positions`)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        side = cfg.image_size // cfg.patch_size
        self.position_embedding = nn.Embedding(side * side, cfg.hidden_size, dtype=dtype)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        table = self.position_embedding.weight
        return hidden + interpolated_positions(table, positions, sizes).to(table.dtype)


def _check(cfg: Any) -> None:
    if cfg.model_type not in _MODEL_TYPES:
        raise NotBuiltError("vision_config.model_type", cfg.model_type, "a vision tower other than GLM-4.1V's")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise NotBuiltError("vision_config.rope_parameters", rope, "a vision rotary embedding other than 'axial'")


class Glm4vVisionTower(nn.Module):
    """Pixels ``[patches, C * temporal_patch * patch * patch]`` (the image processor's ``pixel_values``, all
    images concatenated) and each image's ``(t, h, w)`` in patches -> ``[patches / merge**2, out_hidden_size]``.

    ``tp`` is taken for the family's signature and unused: the tower is whole on every rank."""

    def __init__(self, vision_config: Any, tp: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = vision_config
        _check(cfg)
        self.rope_theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.merge = cfg.spatial_merge_size
        self.out_hidden = cfg.out_hidden_size
        self.patch_embed = QwenPatchEmbed(cfg, cfg.hidden_size, dtype, bias=True)
        self.post_conv_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.embeddings = Glm4vVisionEmbeddings(cfg, dtype)
        self.blocks = nn.ModuleList(Glm4vVisionBlock(cfg, dtype) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, self.merge, self.merge, dtype=dtype)
        self.merger = Glm4vPatchMerger(cfg, dtype)
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        grids = [tuple(int(n) for n in grid) for grid in grid_thw]
        layout = patch_layout(grids, self.merge, None, pixel_values.device)
        if pixel_values.shape[0] != layout.num_patches:
            raise ValueError(f"{pixel_values.shape[0]} patches of pixels for grids {grids} ({layout.num_patches})")
        sizes = torch.cat([torch.tensor([h, w]).expand(t * h * w, 2) for t, h, w in grids]).to(pixel_values.device)
        hidden = self.post_conv_layernorm(self.patch_embed(pixel_values))
        hidden = self.embeddings(hidden, layout.positions, sizes)
        cos, sin = vision_rotary(layout.positions, self.head_dim, self.rope_theta)
        for block in self.blocks:
            hidden = block(hidden, cos, sin, layout.frames)
        units = self.post_layernorm(hidden).view(-1, self.merge, self.merge, hidden.shape[-1]).permute(0, 3, 1, 2)
        return self.merger(self.downsample(units).view(-1, self.out_hidden))
