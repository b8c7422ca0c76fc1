"""Llama 3.2 Vision's image encoder (transformers' ``MllamaVisionModel``), whole on every rank.

An image is up to ``max_num_tiles`` tiles of ``image_size`` pixels (the processor's canvas, padded with zero tiles);
its ``aspect_ratio_id`` (1-based index of the tile grid in ``supported_aspect_ratios``) picks the gated tile and
position embeddings. A local encoder (``num_hidden_layers``) runs every tile's patches plus a class row, padded to a
multiple of 8 rows, with transformers' aspect-ratio mask; a gated global encoder (``num_global_layers``) runs over
all the tiles at once. Each tile's rows are the global encoder's output joined with the local encoder's hidden states
at ``intermediate_layers_indices``: ``[tiles, patches + 1, vision_output_dim]``.

Index i is the state layer i takes (its input: the embeddings for 0), as in Meta's reference (llama-models'
``VisionEncoder`` appends ``x`` before block i), transformers 4 (``hidden_states[0]`` is the embeddings) and vLLM, with
which the checkpoints were trained. transformers 5 (5.24) records each layer's output, so its index i is the input
of layer i + 1: a shift we do not follow (docs/multimodal.md#llama-32-vision).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError

__all__ = ["MllamaVisionModel", "aspect_ratio_mask", "num_tiles_of"]


def num_tiles_of(vision_config: Any, aspect_ratio_id: int) -> int:
    """The tiles of an image of ``aspect_ratio_id`` (its grid's rows times columns)."""
    rows, cols = vision_config.supported_aspect_ratios[aspect_ratio_id - 1]
    return rows * cols


def aspect_ratio_mask(vision_config: Any, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` aspect ratio ids -> ``[N, max_num_tiles]`` long: 1 for each image's own tiles, 0 for its padding."""
    tiles = torch.tensor([num_tiles_of(vision_config, int(i)) for i in aspect_ratio_ids.tolist()])
    return (torch.arange(vision_config.max_num_tiles)[None, :] < tiles[:, None]).long().to(aspect_ratio_ids.device)


def _tile_padding_mask(mask: torch.Tensor, num_patches: int, target_length: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers' ``_prepare_aspect_ratio_attention_mask``: ``[N, tiles]`` -> additive ``[N, 1, L, L]``."""
    batch, tiles = mask.shape
    attention = mask.view(batch, tiles, 1, 1).to(dtype).repeat(1, 1, target_length, 1)
    attention[:, :, -(target_length - num_patches):] = 0
    attention = (1 - attention).reshape(batch, tiles * target_length, 1)
    return (attention @ attention.transpose(-1, -2) * torch.finfo(dtype).min).unsqueeze(1)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False, dtype=dtype)
                                                              for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (proj(x).view(batch, length, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, width))


class _EncoderLayer(nn.Module):
    """Pre-LayerNorm attention and GELU MLP; the global encoder's scaled by ``tanh`` of their gates."""

    def __init__(self, cfg: Any, gated: bool, dtype: torch.dtype) -> None:
        super().__init__()
        width = cfg.hidden_size
        self.self_attn = _Attention(width, cfg.attention_heads, dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(width, cfg.intermediate_size, dtype=dtype)
        self.mlp.fc2 = nn.Linear(cfg.intermediate_size, width, dtype=dtype)
        self.input_layernorm = nn.LayerNorm(width, eps=cfg.norm_eps, dtype=dtype)
        self.post_attention_layernorm = nn.LayerNorm(width, eps=cfg.norm_eps, dtype=dtype)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1, dtype=dtype))
            self.gate_ffn = nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(x), mask)
        x = x + (self.gate_attn.tanh() * out if self.gated else out)
        out = self.mlp.fc2(F.gelu(self.mlp.fc1(self.post_attention_layernorm(x))))
        return x + (self.gate_ffn.tanh() * out if self.gated else out)


class _Encoder(nn.Module):
    def __init__(self, cfg: Any, num_layers: int, gated: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(cfg, gated, dtype) for _ in range(num_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the last layer's output, every layer's input and then the last output: state i is what layer i takes,
        as Meta's encoder and transformers 4 record it; transformers 5 records layer i's output instead, module
        docstring)."""
        states = []
        for layer in self.layers:
            states.append(x)
            x = layer(x, mask)
        return x, [*states, x]


class _AspectRatioEmbedding(nn.Module):
    """A gated embedding per tile of the image's grid (``pre_tile`` / ``post_tile_positional_embedding``)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.tiles, self.width = cfg.max_num_tiles, cfg.hidden_size
        self.embedding = nn.Embedding(len(cfg.supported_aspect_ratios) + 1, self.tiles * self.width, dtype=dtype)
        self.gate = nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        return x + self.embedding(aspect_ratio_ids).reshape(-1, self.tiles, 1, self.width) * self.gate.tanh()


class _PositionEmbedding(nn.Module):
    """The patches' positions, ``1 - tanh(gate)`` of them, plus ``tanh(gate)`` of the grid's per-tile table."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.tiles, self.width = cfg.max_num_tiles, cfg.hidden_size
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.gate = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.embedding = nn.Parameter(torch.zeros(self.num_patches, self.width, dtype=dtype))
        self.tile_embedding = nn.Embedding(len(cfg.supported_aspect_ratios) + 1,
                                           self.tiles * self.num_patches * self.width, dtype=dtype)

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        x = x + ((1 - self.gate.tanh()) * self.embedding).view(1, 1, self.num_patches, self.width)
        tiles = self.tile_embedding(aspect_ratio_ids).reshape(x.shape[0], self.tiles, self.num_patches, self.width)
        return x + self.gate.tanh() * tiles


class MllamaVisionModel(nn.Module):
    """Tiles ``[N, tiles, C, S, S]`` and aspect ratio ids ``[N]`` -> ``[N, tiles, patches + 1, vision_output_dim]``."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.hidden_act != "gelu":
            raise NotBuiltError("vision_config.hidden_act", cfg.hidden_act,
                                f"the {cfg.hidden_act!r} activation in Mllama's vision encoder (only 'gelu')")
        self.cfg = cfg
        width = cfg.hidden_size
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.patch_embedding = nn.Conv2d(cfg.num_channels, width, cfg.patch_size, cfg.patch_size, bias=False,
                                         dtype=dtype)
        self.class_embedding = nn.Parameter(torch.zeros(width, dtype=dtype))
        self.gated_positional_embedding = _PositionEmbedding(cfg, dtype)
        self.pre_tile_positional_embedding = _AspectRatioEmbedding(cfg, dtype)
        self.post_tile_positional_embedding = _AspectRatioEmbedding(cfg, dtype)
        self.layernorm_pre = nn.LayerNorm(width, dtype=dtype)
        self.layernorm_post = nn.LayerNorm(width, dtype=dtype)
        self.transformer = _Encoder(cfg, cfg.num_hidden_layers, False, dtype)
        self.global_transformer = _Encoder(cfg, cfg.num_global_layers, True, dtype)

    def forward(self, pixels: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        n, tiles, channels, height, width = pixels.shape
        dim, dtype = self.cfg.hidden_size, self.patch_embedding.weight.dtype
        x = self.patch_embedding(pixels.reshape(n * tiles, channels, height, width).to(dtype))
        x = x.flatten(2).transpose(1, 2)
        x = self.pre_tile_positional_embedding(x.reshape(n, tiles, -1, dim), aspect_ratio_ids)
        x = torch.cat([self.class_embedding.expand(n * tiles, 1, dim), x.reshape(n * tiles, -1, dim)], dim=1)
        x = self.layernorm_pre(self.gated_positional_embedding(x.reshape(n, tiles, -1, dim), aspect_ratio_ids))
        pad = (8 - x.shape[-2] % 8) % 8
        x = F.pad(x, (0, 0, 0, pad))
        padded = x.shape[2]
        mask = _tile_padding_mask(aspect_ratio_mask(self.cfg, aspect_ratio_ids), self.num_patches, padded, dtype)
        x, local_states = self.transformer(x.view(n, -1, dim), mask)
        x = self.post_tile_positional_embedding(self.layernorm_post(x).reshape(n, tiles, padded, dim),
                                                aspect_ratio_ids)
        x, _ = self.global_transformer(x.reshape(n, tiles * padded, dim), mask)
        picked = torch.stack([local_states[i] for i in self.cfg.intermediate_layers_indices], dim=-1)
        x = torch.cat([x.reshape(n, tiles, padded, dim), picked.reshape(n, tiles, padded, -1)], dim=-1)
        return x[:, :, : self.num_patches]
