"""Tencent HunYuan VL (HunyuanOCR-1B; ``HunYuanVLForConditionalGeneration``): a ViT at each image's own resolution,
a convolutional patch merger that closes every row of merged patches with a newline and wraps the image in begin /
end rows, and HunYuan's dense decoder (asyncllm/models/hunyuan.py) with XD-RoPE. It runs on Qwen2-VL's path
(asyncllm/models/qwen2_vl.py); what differs, following transformers' ``modeling_hunyuan_vl``:

- **Patches**: the image processor (``HunYuanVLImageProcessor``, or its PIL twin) resizes an image to a multiple of
  ``patch_size * merge_size`` pixels between its pixel bounds and cuts it into patches in raster order, so an item
  is ``(1, h, w, C * p * p)``; the prompt's image token (between the start and end tokens) becomes
  ``h/2 * (w/2 + 1) + 2`` placeholders: the begin row, each row of merged patches and its newline, the end row.
- **Tower** (`HunYuanVLVisionTower`): a biased patch convolution plus the learned ``max_image_size / patch_size``
  square position table resampled to the image's grid (bilinear, half-pixel centres, float32), CLIP's encoder layers
  (LayerNorms, biased q / k / v / o, an exact-GELU MLP) attending within the image; sharded over the tensor-parallel
  ranks as CLIP's (or whole: ``mm_encoder_tp_mode="data"``).
- **Merger** (`HunYuanVLPatchMerger`, whole on every rank): RMSNorm, a 2 x 2 stride-2 convolution to twice the width,
  GELU, a 1 x 1 convolution to four times it, the learned ``image_newline`` column after each row, a linear map to the
  decoder's width, the learned ``image_begin`` / ``image_end`` rows around it, RMSNorm.
- **XD-RoPE** (`XDRotaryEmbedding`): ``mrope_section`` (the checkpoints' ``xdrope_section``) has one entry per
  position axis (four: sequence, width, height, image; or three without the sequence axis) summing to
  ``head_dim / 2``; transformers doubles the frequencies to the head's width and cuts that into runs of
  ``2 * section[i]`` columns, run i turning by axis i. Unlike Qwen's M-RoPE a frequency's two halves may take
  different axes, so the step's full-width cos and sin rotate q and k here (HunYuan's attention rotates them itself
  before its per-head norms). Text tokens carry their index on every axis (the ordinary rope); an image's grid
  tokens carry (column, row, the image's ordinal) on the last three axes, its begin and end rows their index
  (`xd_positions`, transformers' ``get_rope_index``); the text resumes at its own index, so later tokens' delta is 0.

Images only (transformers' processor takes no videos). LoRA adapters take the decoder's projections
(`DecoderLoRA`); pipeline stages hold the tower and merger on the first stage. Checkpoints load in either layout:
the released one, which transformers' ``save_pretrained`` writes back (``vit.*`` with ``vit.perceive.*``,
``model.*``), and transformers 5's in memory (``model.vision_tower.*``, ``model.language_model.*``).
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.clip import CLIPEncoder, activation, check_encoder_split
from asyncllm.models.hunyuan import HunYuanDecoderLayer, HunYuanDenseV1ForCausalLM, ntk_alpha_config
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel, head_dim_of
from asyncllm.models.llama import DecoderBuild
from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration, Qwen2VLTextModel
from asyncllm.models.rotary import RotaryEmbedding, rope_parameters
from asyncllm.models.vision_language import load_vision_language_weights

__all__ = ["HunYuanVLForConditionalGeneration", "HunYuanVLVisionTower", "XDRotaryEmbedding",
           "normalize_hunyuan_vl_name", "xd_positions"]


class XDRotaryEmbedding(RotaryEmbedding):
    """The ordinary table (for ``[T]`` positions), and per step the full-width cos / sin of ``[axes, T]`` ones."""

    def __init__(self, hf_config: Any, head_dim: int, max_position: int) -> None:
        super().__init__(ntk_alpha_config(hf_config), head_dim, max_position)
        section = [int(n) for n in rope_parameters(hf_config).get("mrope_section") or ()]
        if len(section) not in (3, 4) or sum(section) != self.rotary_dim // 2:
            raise ConfigError("rope_parameters.mrope_section", section,
                              f"three or four axis sizes adding up to head_dim / 2 = {self.rotary_dim // 2}")
        axes = torch.repeat_interleave(torch.arange(len(section)), 2 * torch.tensor(section),
                                       output_size=2 * sum(section))  # a meta tensor (the roofline's) cannot count it
        self.register_buffer("column_axis", axes, persistent=False)
        self.num_axes = len(section)
        self.step: tuple[torch.Tensor, torch.Tensor] | None = None

    def step_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[axes, T]`` positions -> ``[T, head_dim]`` float32 cos and sin, each column from its run's axis."""
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [axes, T, head_dim / 2]
        index = self.column_axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return torch.cat([cos, cos], -1).gather(0, index)[0], torch.cat([sin, sin], -1).gather(0, index)[0]

    @contextmanager
    def rotating_by(self, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """While inside, `forward` turns the step's rows by their XD-RoPE tables; yields positions for the backends'
        identity table (any in range)."""
        self.step = self.step_tables(positions)
        try:
            yield positions[0]
        finally:
            self.step = None

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step is None:
            return super().forward(positions, query, key)
        cos, sin = (table.to(query.dtype).unsqueeze(1) for table in self.step)
        return (query * cos + reference.rotate_half(query) * sin, key * cos + reference.rotate_half(key) * sin)


def xd_positions(prompt_len: int, images: Sequence[tuple[int, int, Sequence[int]]], merge: int,
                 num_axes: int) -> tuple[np.ndarray, int]:
    """(``[num_axes, prompt_len]`` int64 positions, delta) of a prompt whose images are ``(offset, length, (t, h,
    w))`` (grid in patches, placeholders in order): every token at its index on every axis, but each image's grid
    tokens (all its placeholders but the first and last) at (column, row, image ordinal) on the last three axes,
    the column running to ``w / merge`` (the row's newline)."""
    table = np.tile(np.arange(prompt_len, dtype=np.int64), (num_axes, 1))
    for ordinal, (offset, length, (t, h, w)) in enumerate(images):
        rows, cols = h // merge, w // merge + 1
        if t != 1 or rows * cols + 2 != length:
            raise ValueError(f"an image of grid {(t, h, w)} has {length} placeholder tokens, not {rows * cols + 2}")
        grid = slice(offset + 1, offset + 1 + rows * cols)
        row, col = np.indices((rows, cols)).reshape(2, -1)
        table[num_axes - 3, grid], table[num_axes - 2, grid], table[num_axes - 1, grid] = col, row, ordinal
    delta = int(table.max()) + 1 - prompt_len if prompt_len else 0
    return table, delta


class HunYuanVLVisionEmbeddings(nn.Module):
    """Flattened patches ``[M, C * p * p]`` -> ``[N, h * w, hidden]`` plus the position table resampled to h x w."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.channels, self.patch = int(cfg.num_channels), int(cfg.patch_size)
        self.patch_embedding = nn.Conv2d(self.channels, cfg.hidden_size, kernel_size=self.patch, stride=self.patch)
        self.edge = int(cfg.max_image_size) // self.patch
        self.position_embedding = nn.Embedding(self.edge ** 2 + 1, cfg.hidden_size)  # row 0 unused
        self.mode = getattr(cfg, "interpolate_mode", "bilinear")  # transformers' F.interpolate mode, align_corners off
        if self.mode not in ("bilinear", "bicubic"):
            raise NotBuiltError("vision_config.interpolate_mode", self.mode, "bilinear or bicubic")

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """The table (past its first row) resized to ``rows x cols``, row by row: ``[rows * cols, hidden]``."""
        table = self.position_embedding.weight
        grid = table[1:].reshape(1, self.edge, self.edge, -1).permute(0, 3, 1, 2).float()
        resized = F.interpolate(grid, size=(rows, cols), mode=self.mode, align_corners=False)
        return resized.permute(0, 2, 3, 1).reshape(rows * cols, -1).to(table.dtype)

    def forward(self, patches: torch.Tensor, n: int, rows: int, cols: int) -> torch.Tensor:
        weight = self.patch_embedding.weight
        pixels = patches.reshape(-1, self.channels, self.patch, self.patch).to(weight.dtype)
        embedded = self.patch_embedding(pixels).flatten(1).view(n, rows * cols, -1)
        return embedded + self.positions(rows, cols)


class HunYuanVLPatchMerger(nn.Module):
    """``[N, h * w, hidden]`` -> ``[N, h/2 * (w/2 + 1) + 2, text hidden]`` (see the module's docstring)."""

    def __init__(self, cfg: Any, text_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, merge = int(cfg.hidden_size), int(cfg.spatial_merge_size)
        self.before_rms = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.proj_conv = nn.Conv2d(hidden, 2 * hidden, kernel_size=merge, stride=merge, dtype=dtype)
        self.proj_out = nn.Conv2d(2 * hidden, 4 * hidden, kernel_size=1, dtype=dtype)
        self.mlp = nn.Linear(4 * hidden, text_hidden, dtype=dtype)
        self.image_newline = nn.Parameter(torch.empty(4 * hidden, dtype=dtype), requires_grad=False)
        self.image_begin = nn.Parameter(torch.empty(text_hidden, dtype=dtype), requires_grad=False)
        self.image_end = nn.Parameter(torch.empty(text_hidden, dtype=dtype), requires_grad=False)
        self.image_sep = nn.Parameter(torch.empty(text_hidden, dtype=dtype), requires_grad=False)  # unused, loaded
        self.after_rms = RMSNorm(text_hidden, cfg.rms_norm_eps, dtype)
        self.act = activation(cfg.hidden_act, "vision_config.hidden_act")  # the tower's, as transformers' merger

    def forward(self, hidden: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        x = self.before_rms(hidden)
        n = x.shape[0]
        x = self.proj_out(self.act(self.proj_conv(x.transpose(1, 2).reshape(n, -1, rows, cols))))
        newline = self.image_newline.to(x.dtype).view(1, -1, 1, 1).expand(n, -1, x.shape[2], 1)
        x = self.mlp(torch.cat([x, newline], -1).flatten(2).transpose(1, 2))
        ends = [edge.to(x.dtype).view(1, 1, -1).expand(n, 1, -1) for edge in (self.image_begin, self.image_end)]
        return self.after_rms(torch.cat([ends[0], x, ends[1]], 1))


class HunYuanVLVisionTower(nn.Module):
    """Patches ``[M, C * p * p]`` of images of one grid ``[(1, h, w)] * N`` -> ``[N * tokens, text hidden]``."""

    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        check_encoder_split(tp.size, {"vision_config.num_attention_heads": cfg.num_attention_heads,
                                      "vision_config.intermediate_size": cfg.intermediate_size})
        self.embeddings = HunYuanVLVisionEmbeddings(cfg).to(dtype)
        self.encoder = CLIPEncoder(cfg, tp, dtype)
        self.merger = HunYuanVLPatchMerger(cfg, int(cfg.text_hidden_size), dtype)

    def forward(self, patches: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        if any(g != grid[0] for g in grid) or grid[0][0] != 1:
            raise ValueError(f"a batch of images of one grid (1, h, w), not {grid}")
        _, rows, cols = grid[0]
        hidden = self.embeddings(patches, len(grid), rows, cols)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        out = self.merger(hidden, rows, cols)
        return out.reshape(-1, out.shape[-1])


class HunYuanVLTextModel(Qwen2VLTextModel):
    """HunYuan's dense layers; ``[axes, T]`` positions rotate by the step's XD-RoPE tables."""

    layer_cls = HunYuanDecoderLayer


class HunYuanVLLanguageModel(HunYuanDenseV1ForCausalLM):
    """HunYuan's dense decoder whose q / k rotation is XD-RoPE's."""

    model_cls = HunYuanVLTextModel

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        rotary = XDRotaryEmbedding(hf_config, head_dim_of(hf_config), max_position)
        return dataclasses.replace(build, rotary_emb=rotary)


_TOWER_NAMES = ((r"^(?:vit|model\.vision_tower)\.(?:perceive|patch_merger)\.proj\.0\.", "visual.merger.proj_conv."),
                (r"^(?:vit|model\.vision_tower)\.(?:perceive|patch_merger)\.proj\.2\.", "visual.merger.proj_out."),
                (r"^(?:vit|model\.vision_tower)\.(?:perceive|patch_merger)\.", "visual.merger."),
                (r"^(?:vit|model\.vision_tower)\.embeddings\.", "visual.embeddings."),
                (r"^(?:vit|model\.vision_tower)\.layers\.", "visual.encoder.layers."),
                (r"\.(?:input_layernorm|layer_norm1)\.", ".layer_norm1."),
                (r"\.(?:post_attention_layernorm|layer_norm2)\.", ".layer_norm2."),
                (r"\.mlp\.dense_h_to_4h\.", ".mlp.fc1."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.fc2."),
                (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."))


def normalize_hunyuan_vl_name(name: str) -> str:
    """Either checkpoint layout -> ours: ``visual.embeddings.*``, ``visual.encoder.layers.*`` (CLIP's names),
    ``visual.merger.*``, ``language_model.model.*``, ``language_model.lm_head.*``."""
    if name.startswith(("vit.", "model.vision_tower.")):
        for pattern, ours in _TOWER_NAMES:
            name = re.sub(pattern, ours, name)
        return name
    name = name.removeprefix("model.language_model.").removeprefix("language_model.model.").removeprefix("model.")
    return "language_model." + name if name.startswith("lm_head.") else "language_model.model." + name


class HunYuanVLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Image features (tower, then merger) replace the image token's placeholders; positions are XD-RoPE's;
    images only."""

    tower_cls = HunYuanVLVisionTower
    language_model_cls = HunYuanVLLanguageModel
    normalize_name = staticmethod(normalize_hunyuan_vl_name)
    mm_placeholder_around = {"image": ("im_start_id", "im_end_id")}
    mm_video_token_id = None
    """No videos (transformers' ``HunYuanVLProcessor`` takes none)."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.num_axes = self.language_model.model.rotary_emb.num_axes

    @staticmethod
    def mm_placeholder_length(hf_config: Any, pixel_shape: tuple[int, ...]) -> int:
        """An image of ``(1, h, w, features)`` patches: a row of ``w / 2 + 1`` per 2 rows, the begin and end."""
        t, h, w = pixel_shape[:3]
        merge = int(hf_config.vision_config.spatial_merge_size)
        return t * (h // merge) * (w // merge + 1) + 2

    def mrope_positions(self, prompt_len: int, items: list[Any]) -> tuple[np.ndarray, int]:
        """The prompt's ``[axes, prompt_len]`` XD-RoPE positions and the delta of every later token (0)."""
        images = [(item.offset, item.length, tuple(item.shape[:3])) for item in items]
        return xd_positions(prompt_len, images, self.merge, self.num_axes)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return load_vision_language_weights(self, weights, normalize_hunyuan_vl_name, "HunYuan VL")
