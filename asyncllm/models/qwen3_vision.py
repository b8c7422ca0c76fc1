"""The vision encoder of Qwen3-VL (transformers' ``Qwen3VLVisionModel``, ``model.visual``).

It is Qwen2-VL's tower (asyncllm/models/qwen_vision.py: patches in merge-unit order, a
Conv3d run as one matmul per patch, LayerNorm blocks attending within each frame, the 2-D
rotary) with three changes:

- ``patch_embed.proj`` has a bias, and ``pos_embed``, a learned ``side x side`` table of
  position embeddings, is resampled to each image's patch grid (bilinear, corners aligned:
  the table's corner entries land on the image's corner patches) and added to the patch
  embeddings. The resampling runs in float32 as transformers does, so bf16 towers agree.
- the MLP is ``linear_fc1`` -> ``hidden_act`` -> ``linear_fc2``; the merger is ``norm``
  (per patch), each unit's patches concatenated, ``linear_fc1``, GELU, ``linear_fc2``.
- deepstack: the output of each block in ``deepstack_visual_indexes`` goes through its own
  merger in ``deepstack_merger_list``, whose ``norm`` is over the concatenated unit
  (``4 * hidden``) instead. The text model adds those features to its early layers' hidden
  states at the image tokens, so the tower returns them beside the main features, concatenated
  along the last dimension: one tensor per image, as the encoder cache holds it.

Sharding follows qwen_vision.py: ``attn.qkv`` by heads, the MLP's and every merger's
``linear_fc1`` column-parallel, ``attn.proj`` and every ``linear_fc2`` row-parallel; the
norms, ``patch_embed`` and ``pos_embed`` are replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.clip import activation, check_encoder_split
from asyncllm.models.layers import TensorParallel
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.qwen_vision import QwenPatchEmbed, QwenVisionAttention, Segments, patch_layout, vision_rotary

__all__ = ["Qwen3VisionTower", "check_qwen3_vision_tensor_parallel"]

_MODEL_TYPES = ("qwen3_vl_vision", "qwen3_vl_moe_vision", "qwen3_5_vision", "qwen3_5_moe_vision",
                "qwen3_omni_moe_vision_encoder")
"""Qwen3-VL's tower, and Qwen3-VL-MoE's and Qwen3-Omni's (the same tower under its own name)."""
_NORM_EPS = 1e-6  # fixed in transformers, not read from the config


def check_qwen3_vision_tensor_parallel(cfg: Any, tp_size: int) -> None:
    """`NotBuiltError` unless ``cfg`` is Qwen3-VL's tower; `ConfigError` unless its heads, MLP and mergers
    split evenly over ``tp_size`` ranks."""
    if cfg.model_type not in _MODEL_TYPES:
        raise NotBuiltError("vision_config.model_type", cfg.model_type, "a vision tower other than Qwen3-VL's")
    check_encoder_split(tp_size, {"vision_config.num_heads": cfg.num_heads,
                                  "vision_config.intermediate_size": cfg.intermediate_size,
                                  "merger width": cfg.hidden_size * cfg.spatial_merge_size**2})


def deepstack_indexes(cfg: Any) -> list[int]:
    """The blocks whose outputs feed deepstack mergers (none in Qwen3.5's tower, which has no such field)."""
    return list(getattr(cfg, "deepstack_visual_indexes", None) or [])


def _check_deepstack(cfg: Any) -> None:
    """Each deepstack feature feeds one text layer: a missing or repeated block would shift them all."""
    indexes = list(deepstack_indexes(cfg))
    if len(set(indexes)) != len(indexes) or not all(0 <= i < cfg.depth for i in indexes):
        raise ConfigError("vision_config.deepstack_visual_indexes", indexes,
                          f"distinct block indexes in [0, {cfg.depth})")


def _bilinear_taps(positions: torch.Tensor, sizes: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4 entries of the flattened ``side x side`` table and their float32 weights that resample it, corners
    aligned, at each patch: positions and sizes ``[N, 2]`` are the patch's (row, col) and its image's (h, w)."""
    source = positions.float() * (side - 1) / (sizes - 1).clamp(min=1)  # a 1-patch axis reads entry 0
    floor = source.floor()
    frac = source - floor
    low = floor.long()
    taps = torch.stack([low, (low + 1).clamp(max=side - 1)], dim=-1)  # [N, axis, 2]
    weights = torch.stack([1 - frac, frac], dim=-1)
    indices = taps[:, 0, :, None] * side + taps[:, 1, None, :]
    return indices.flatten(1), (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)


def _grid_sizes(grids: Sequence[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """Each patch's image (h, w) ``[N, 2]``, in the patches' order."""
    return torch.cat([torch.tensor([h, w]).expand(t * h * w, 2) for t, h, w in grids]).to(device)


class Qwen3VisionMLP(nn.Module):
    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(cfg.hidden_act, "vision_config.hidden_act")
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp, dtype)
        self.linear_fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_NORM_EPS, dtype=dtype)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_NORM_EPS, dtype=dtype)
        self.attn = QwenVisionAttention(cfg.hidden_size, cfg.num_heads, tp, dtype)
        self.mlp = Qwen3VisionMLP(cfg, tp, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """Each merge unit's patches -> one text-sized embedding; ``postshuffle``: the norm is over the whole unit
    (the deepstack mergers) rather than per patch (the main merger)."""

    def __init__(self, cfg: Any, postshuffle: bool, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else cfg.hidden_size, eps=_NORM_EPS, dtype=dtype)
        self.linear_fc1 = ColumnParallelLinear(self.hidden, self.hidden, True, tp, dtype)
        self.act = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.hidden, cfg.out_hidden_size, True, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        units = self.norm(x.reshape(-1, self.hidden)) if self.postshuffle else self.norm(x).reshape(-1, self.hidden)
        return self.linear_fc2(self.act(self.linear_fc1(units)))


class Qwen3VisionTower(nn.Module):
    """Pixels ``[patches, C * temporal_patch * patch * patch]`` (the image processor's ``pixel_values``, all
    images concatenated) and each image's ``(t, h, w)`` in patches -> ``[patches / merge**2, out_hidden *
    (1 + num_deepstack)]``: the main merger's features, then each deepstack merger's, in block order."""

    def __init__(self, vision_config: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = vision_config
        check_qwen3_vision_tensor_parallel(cfg, tp.size)
        _check_deepstack(cfg)
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise NotBuiltError("vision_config.rope_parameters", rope, "a vision rotary embedding other than 'axial'")
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.merge = cfg.spatial_merge_size
        self.side = math.isqrt(cfg.num_position_embeddings)  # transformers reads the table as square
        self.patch_embed = QwenPatchEmbed(cfg, cfg.hidden_size, dtype, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.pos_embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(cfg, tp, dtype) for _ in range(cfg.depth))
        self.merger = Qwen3PatchMerger(cfg, False, tp, dtype)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(cfg, True, tp, dtype) for _ in deepstack_indexes(cfg))
        self.deepstack_mergers = {block: i for i, block in enumerate(deepstack_indexes(cfg))}
        self.num_deepstack = len(self.deepstack_merger_list)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        grids = [tuple(int(n) for n in grid) for grid in grid_thw]
        layout = patch_layout(grids, self.merge, None, pixel_values.device)
        if pixel_values.shape[0] != layout.num_patches:
            raise ValueError(f"{pixel_values.shape[0]} patches of pixels for grids {grids} ({layout.num_patches})")
        hidden = self.patch_embed(pixel_values)
        hidden = hidden + self._position_embeddings(layout.positions, grids).to(hidden.dtype)
        cos, sin = vision_rotary(layout.positions, self.head_dim, self.rope_theta)
        features = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin, layout.frames)
            if index in self.deepstack_mergers:
                features.append(self.deepstack_merger_list[self.deepstack_mergers[index]](hidden))
        return torch.cat([self.merger(hidden), *features], dim=-1)

    def _position_embeddings(self, positions: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``pos_embed`` resampled at each patch ``[N, hidden]``, float32."""
        indices, weights = _bilinear_taps(positions, _grid_sizes(grids, positions.device), self.side)
        return (self.pos_embed.weight[indices] * weights[..., None]).sum(1)
