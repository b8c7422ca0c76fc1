"""The vision encoder of Qwen2-VL and Qwen2.5-VL (transformers' ``model.visual``).

The image processor cuts an image into ``t x h x w`` patches of ``C x temporal_patch x
patch x patch`` pixels, ordered so that each ``spatial_merge_size ** 2`` consecutive
patches form one merge unit (a small square of patches that becomes one text token).
``patch_embed`` is a Conv3d whose stride is its kernel, so it is run as one matmul over
each flattened patch. Then ``blocks``: pre-norm attention and MLP, with a 2-D rotary
embedding (the first half of each head's rotated pairs turn with the patch's row, the
second half with its column; angles in float32 as transformers does). Then ``merger``:
``ln_q`` per patch, each unit's patches concatenated, ``mlp.0``, GELU, ``mlp.2`` -> one
embedding of the text hidden size per unit. Attention never crosses an image frame.

Qwen2-VL: LayerNorm, an ``fc1`` / ``fc2`` MLP. Qwen2.5-VL: RMSNorm, a gated MLP
(``gate_proj``, ``up_proj``, ``down_proj``) and window attention: the units are
reordered window by window (``window_size`` pixels square, partial at the right and
bottom edges), blocks outside ``fullatt_block_indexes`` attend within a window only,
and the merger's output is put back in the processor's order.

Sharding over ``tp`` follows our CLIP tower: each rank keeps ``heads / tp`` heads of the
fused ``attn.qkv`` (its rows of q, of k and of v), ``1 / tp`` of the MLP features and of
the merger's ``mlp.0`` features; ``attn.proj``, the MLP's out projection and
``merger.mlp.2`` are row-parallel (one all-reduce each). The norms and the patch
embedding are replicated. Images are few per step, so attention is plain SDPA, the
segments of one length batched together.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.clip import activation, check_encoder_split
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel, set_weight_loader, weight_narrow
from asyncllm.models.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

__all__ = ["QwenPatchEmbed", "QwenVisionAttention", "QwenVisionTower", "Segments", "check_vision_tensor_parallel",
           "rotate_vision",
           "patch_layout", "vision_rotary"]

_QWEN2_VL = ("qwen2_vl_vision", "qwen2_vl")
_QWEN2_5_VL = ("qwen2_5_vl_vision", "qwen2_5_vl", "qwen2_5_omni_vision_encoder")
"""transformers 5 names the vision configs ``*_vision``; configs made by 4.x say the model's type. Qwen2.5-Omni's
tower is Qwen2.5-VL's (asyncllm/models/qwen2_5_omni.py)."""
_NORM_EPS = 1e-6  # fixed in transformers, not read from the config


@dataclass(frozen=True)
class _Widths:
    """The sizes the two generations name differently."""

    qwen2_5: bool
    width: int  # the blocks' hidden size
    mlp: int  # the MLP's features
    out: int  # the merger's output: the text hidden size


def _widths(cfg: Any) -> _Widths:
    if cfg.model_type in _QWEN2_VL:
        return _Widths(False, cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio), cfg.hidden_size)
    if cfg.model_type in _QWEN2_5_VL:
        return _Widths(True, cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size)
    raise NotBuiltError("vision_config.model_type", cfg.model_type,
                        "a vision tower other than Qwen2-VL's / Qwen2.5-VL's")


def check_vision_tensor_parallel(cfg: Any, tp_size: int) -> None:
    """`ConfigError` unless the tower's heads, MLP and merger split evenly over ``tp_size`` ranks."""
    widths = _widths(cfg)
    check_encoder_split(tp_size, {"vision_config.num_heads": cfg.num_heads, "MLP width": widths.mlp,
                                  "merger width": widths.width * cfg.spatial_merge_size**2})


class Segments:
    """Runs of consecutive tokens that attend only among themselves (frames or windows).

    Runs of one length are gathered into one batched SDPA call: a Qwen2.5-VL image has
    dozens of windows, nearly all of the same size.
    """

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        starts_by_length: dict[int, list[int]] = {}
        for start, length in zip(itertools.accumulate([0] + lengths[:-1]), lengths):
            starts_by_length.setdefault(length, []).append(start)
        self.groups = [
            (len(starts), (torch.tensor(starts)[:, None] + torch.arange(length)).flatten().to(device))
            for length, starts in starts_by_length.items()
        ]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v ``[N, H, D]`` -> ``[N, H, D]``, bidirectional within each run."""
        out = torch.empty_like(q)
        for count, index in self.groups:
            runs = (x[index].view(count, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
            attended = F.scaled_dot_product_attention(*runs)
            out[index] = attended.transpose(1, 2).reshape(-1, *q.shape[1:])
        return out


def _patch_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(row, col) of each patch ``[t * h * w, 2]`` in the processor's order: unit by unit, row-major in each."""
    shape = (h // merge, w // merge, merge, merge)
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(shape)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(shape)
    return torch.stack([rows.flatten(), cols.flatten()], dim=-1).repeat(t, 1)


def _window_order(t: int, unit_rows: int, unit_cols: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The units of one image in window order (frame, window row, window column, then row-major inside
    the window, as transformers' ``get_window_index``), and each window's unit count."""
    frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(unit_rows), torch.arange(unit_cols), indexing="ij")
    window = (frame * -(-unit_rows // side) + row // side) * -(-unit_cols // side) + col // side
    key = window * side * side + (row % side) * side + col % side
    return key.flatten().argsort(), torch.bincount(window.flatten()).tolist()


@dataclass(frozen=True)
class PatchLayout:
    """Where one forward's patches sit and which of them attend to each other."""

    positions: torch.Tensor  # [N, 2] (row, col) of each patch, in the blocks' order
    frames: Segments
    windows: Segments | None  # Qwen2.5-VL's windows in the blocks' order (None: Qwen2-VL)
    units: torch.Tensor | None  # the blocks' order of merge units (None: the processor's)
    num_patches: int


def patch_layout(grid_thw: Sequence[tuple[int, int, int]], merge: int, window: int | None, device: torch.device) -> PatchLayout:
    unit = merge * merge
    positions, frame_lengths, units, window_lengths, num_units = [], [], [], [], 0
    for t, h, w in grid_thw:
        if h % merge or w % merge:
            raise ValueError(f"an image grid of {h} x {w} patches, which spatial_merge_size={merge} does not divide")
        positions.append(_patch_positions(t, h, w, merge))
        frame_lengths += [h * w] * t
        if window is not None:
            order, lengths = _window_order(t, h // merge, w // merge, window)
            units.append(order + num_units)
            window_lengths += [n * unit for n in lengths]
        num_units += t * h * w // unit
    position = torch.cat(positions)
    if window is None:
        return PatchLayout(position.to(device), Segments(frame_lengths, device), None, None, len(position))
    unit_order = torch.cat(units)
    patch_order = (unit_order[:, None] * unit + torch.arange(unit)).flatten()
    return PatchLayout(position[patch_order].to(device), Segments(frame_lengths, device),
                   Segments(window_lengths, device), unit_order.to(device), len(position))


def vision_rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[N, head_dim]`` (float32) of patches at (row, col) ``positions``: a quarter of the angles from
    the row, a quarter from the column, the halves repeated (``rotate_half`` pairs dim i with i + head_dim / 2)."""
    half = head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float32, device=positions.device) / half
    inv_freq = 1.0 / theta**exponents
    angles = (positions[:, :, None].float() * inv_freq).flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_vision(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding on ``[N, H, D]`` in float32 (transformers' rounding), back in x's dtype."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos[:, None] + torch.cat((-second, first), dim=-1) * sin[:, None]).to(x.dtype)


class _FusedQKV(QKVParallelLinear):
    """``attn.qkv``: the checkpoint stacks q, k and v in one tensor; each rank keeps its heads' rows of each."""

    def __init__(self, width: int, heads: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__(width, width // heads, heads, heads, True, tp, dtype)
        self.width = width
        for param in (self.weight, self.bias):
            set_weight_loader(param, self.load_fused)

    def load_fused(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        for index, shard_id in enumerate(("q", "k", "v")):
            self.weight_loader(param, weight_narrow(loaded, 0, index * self.width, self.width), shard_id)


class QwenVisionAttention(nn.Module):
    def __init__(self, width: int, heads: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.qkv = _FusedQKV(width, heads, tp, dtype)
        self.proj = RowParallelLinear(width, width, True, tp, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        q, k, v = self.qkv.split_qkv(self.qkv(x))
        out = segments.attend(rotate_vision(q, cos, sin), rotate_vision(k, cos, sin), v)
        return self.proj(out.flatten(1))


class QwenVisionMLP(nn.Module):
    """Qwen2-VL's ``fc2(act(fc1(x)))``."""

    def __init__(self, cfg: Any, widths: _Widths, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(cfg.hidden_act, "vision_config.hidden_act")
        self.fc1 = ColumnParallelLinear(widths.width, widths.mlp, True, tp, dtype)
        self.fc2 = RowParallelLinear(widths.mlp, widths.width, True, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class QwenVisionGatedMLP(nn.Module):
    """Qwen2.5-VL's ``down_proj(act(gate_proj(x)) * up_proj(x))``; the checkpoint keeps gate and up apart."""

    def __init__(self, cfg: Any, widths: _Widths, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(cfg.hidden_act, "vision_config.hidden_act")
        self.gate_proj = ColumnParallelLinear(widths.width, widths.mlp, True, tp, dtype)
        self.up_proj = ColumnParallelLinear(widths.width, widths.mlp, True, tp, dtype)
        self.down_proj = RowParallelLinear(widths.mlp, widths.width, True, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(widths: _Widths, dtype: torch.dtype) -> nn.Module:
    if widths.qwen2_5:
        return RMSNorm(widths.width, _NORM_EPS, dtype)
    return nn.LayerNorm(widths.width, eps=_NORM_EPS, dtype=dtype)


class QwenVisionBlock(nn.Module):
    def __init__(self, cfg: Any, widths: _Widths, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _norm(widths, dtype)
        self.norm2 = _norm(widths, dtype)
        self.attn = QwenVisionAttention(widths.width, cfg.num_heads, tp, dtype)
        mlp = QwenVisionGatedMLP if widths.qwen2_5 else QwenVisionMLP
        self.mlp = mlp(cfg, widths, tp, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class QwenPatchEmbed(nn.Module):
    """``proj`` keeps the checkpoint's Conv3d weight; with stride == kernel the conv is a matmul per patch."""

    def __init__(self, cfg: Any, width: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, width, kernel, stride=kernel, bias=bias, dtype=dtype)
        self.proj.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        patch_size = weight[0].numel()
        if pixel_values.dim() != 2 or pixel_values.shape[1] != patch_size:
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}, expected [patches, {patch_size}]")
        out = F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))
        return out if self.proj.bias is None else out + self.proj.bias  # Qwen3-VL's conv has a bias


class QwenPatchMerger(nn.Module):
    """Each merge unit's patches -> one text-sized embedding: ``mlp.0`` column-, ``mlp.2`` row-parallel."""

    def __init__(self, cfg: Any, widths: _Widths, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = widths.width * cfg.spatial_merge_size**2
        self.ln_q = _norm(widths, dtype)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.hidden, self.hidden, True, tp, dtype),
            nn.GELU(),
            RowParallelLinear(self.hidden, widths.out, True, tp, dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden))


class QwenVisionTower(nn.Module):
    """Pixels ``[patches, C * temporal_patch * patch * patch]`` (the image processor's ``pixel_values``, all
    images concatenated) and each image's ``(t, h, w)`` in patches -> ``[patches / merge**2, text hidden]``."""

    def __init__(self, vision_config: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = vision_config
        widths = _widths(cfg)
        check_vision_tensor_parallel(cfg, tp.size)
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise NotBuiltError("vision_config.rope_parameters", rope, "a vision rotary embedding other than 'axial'")
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.head_dim = widths.width // cfg.num_heads
        self.merge = cfg.spatial_merge_size
        self.window, self.full_attention = None, frozenset(range(cfg.depth))
        if widths.qwen2_5:
            self.window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
            if self.window < 1:
                raise ConfigError("vision_config.window_size", cfg.window_size, "at least one merge unit wide")
            self.full_attention = frozenset(cfg.fullatt_block_indexes)
        self.patch_embed = QwenPatchEmbed(cfg, widths.width, dtype)
        self.blocks = nn.ModuleList(QwenVisionBlock(cfg, widths, tp, dtype) for _ in range(cfg.depth))
        self.merger = QwenPatchMerger(cfg, widths, tp, dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        grids = [tuple(int(n) for n in grid) for grid in grid_thw]
        layout = patch_layout(grids, self.merge, self.window, pixel_values.device)
        if pixel_values.shape[0] != layout.num_patches:
            raise ValueError(f"{pixel_values.shape[0]} patches of pixels for grids {grids} ({layout.num_patches})")
        hidden = self.patch_embed(pixel_values)
        cos, sin = vision_rotary(layout.positions, self.head_dim, self.rope_theta)
        if layout.units is not None:
            hidden = hidden.view(len(layout.units), -1, hidden.shape[-1])[layout.units].flatten(0, 1)
        for index, block in enumerate(self.blocks):
            windowed = layout.windows is not None and index not in self.full_attention
            hidden = block(hidden, cos, sin, layout.windows if windowed else layout.frames)
        merged = self.merger(hidden)
        if layout.units is None:
            return merged
        restored = torch.empty_like(merged)
        restored[layout.units] = merged
        return restored


