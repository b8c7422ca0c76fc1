"""The CLIP ViT vision tower of LLaVA-style models.

Module and parameter names mirror transformers' ``CLIPVisionTransformer``
(``embeddings``, ``pre_layrnorm`` sic, ``encoder.layers``, ``post_layernorm``) so
checkpoint names map one to one. Images are few per step, so the tower runs in
plain torch (SDPA over whole images, no paged KV). Its encoder layers are sharded
over ``tp`` like the decoder's: q/k/v and ``fc1`` column-parallel (each rank keeps
``heads / tp`` attention heads and ``intermediate / tp`` MLP features), ``out_proj``
and ``fc2`` row-parallel (one all-reduce each); the patch and position embeddings
and the layer norms are replicated. LLaVA passes a one-rank ``tp`` for
``mm_encoder_tp_mode="data"``, where the whole tower lives on every rank and the
images are split instead (workers/mm_encoder.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["CLIPVisionTower", "activation", "check_encoder_split", "quick_gelu"]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,  # transformers' other name for it (Phi-4-multimodal's audio conformer)
}


def activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name`` in an HF config; `NotBuiltError` naming ``field`` otherwise."""
    if name not in _ACTIVATIONS:
        raise NotBuiltError(field, name, f"the {name!r} activation (built: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def check_encoder_split(tp_size: int, sizes: dict[str, int]) -> None:
    """`ConfigError` on ``tensor_parallel_size`` naming each of a vision encoder's sharded ``sizes`` (config field ->
    value: its heads, MLP width, ...) that ``tp_size`` does not divide, before the shards are built (where
    `TensorParallel.split` would only assert). Every family calling it also serves ``mm_encoder_tp_mode="data"``."""
    problems = [f"{name}={size}" for name, size in sizes.items() if size % tp_size]
    if problems:
        raise ConfigError("tensor_parallel_size", tp_size,
                          f"a size that divides the vision encoder's {', '.join(problems)} with "
                          "mm_encoder_tp_mode='weights' (mm_encoder_tp_mode='data' keeps the encoder whole on every "
                          "rank and takes any size)")


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.num_positions = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        embeddings = torch.cat([cls, patches], dim=1)
        if embeddings.shape[1] != self.num_positions:
            raise ValueError(f"{embeddings.shape[1] - 1} patches, the vision tower expects {self.num_positions - 1}")
        return embeddings + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Bidirectional self-attention over this rank's ``heads / tp`` heads."""

    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = tp.split(cfg.num_attention_heads)
        self.head_dim = hidden // cfg.num_attention_heads
        self.q_proj = ColumnParallelLinear(hidden, hidden, True, tp, dtype)
        self.k_proj = ColumnParallelLinear(hidden, hidden, True, tp, dtype)
        self.v_proj = ColumnParallelLinear(hidden, hidden, True, tp, dtype)
        self.out_proj = RowParallelLinear(hidden, hidden, True, tp, dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: SDPA's ``attn_mask`` (Phi-4-multimodal's crops: ``[N, 1, 1, length]``, False on padding)."""
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(cfg.hidden_act, "vision_config.hidden_act")
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, tp, dtype)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = CLIPAttention(cfg, tp, dtype)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(cfg, tp, dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg, tp, dtype) for _ in range(cfg.num_hidden_layers))


class CLIPVisionTower(nn.Module):
    """Pixels ``[N, C, H, W]`` -> the hidden states of one encoder layer ``[N, 1 + patches, hidden]``.

    ``feature_layer`` indexes transformers' ``hidden_states`` tuple (0 = the
    embeddings after ``pre_layrnorm``, -1 = the last layer), so layers after it are
    never run. ``post_layernorm`` only feeds CLIP's pooled output, which LLaVA does
    not use; it is kept so that the checkpoint loads completely.
    """

    def __init__(self, cfg: Any, feature_layer: int, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        if not isinstance(feature_layer, int):
            raise NotBuiltError("vision_feature_layer", feature_layer, "a single feature layer (not a list)")
        num_layers = cfg.num_hidden_layers
        self.num_layers_run = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
        if not 0 <= self.num_layers_run <= num_layers:
            raise NotBuiltError("vision_feature_layer", feature_layer, f"a layer index in [-{num_layers + 1}, {num_layers}]")
        self.embeddings = CLIPVisionEmbeddings(cfg).to(dtype)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.encoder = CLIPEncoder(cfg, tp, dtype)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers[: self.num_layers_run]:
            hidden = layer(hidden)
        return hidden
