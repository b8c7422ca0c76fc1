"""The SigLIP ViT vision tower (Gemma 3's image encoder).

Names mirror transformers' ``SiglipVisionTransformer`` (``embeddings``, ``encoder.layers``,
``post_layernorm``) so checkpoint names map one to one. Its encoder layers are CLIP's (clip.py:
LayerNorm, bidirectional SDPA attention with biases, a two-layer MLP with the config's activation);
the differences are in the ends: the patch convolution has a bias, there is no class token and no
norm before the layers, and the last layer's output goes through ``post_layernorm``. Images must be
the tower's ``image_size`` (no position interpolation). The pooling head (``vision_use_head``) is not built:
Gemma 3 uses the patch features, and its loader leaves a checkpoint's head weights unread, as transformers does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.models.clip import CLIPEncoder
from asyncllm.models.layers import TensorParallel

__all__ = ["SiglipVisionTower"]


class SiglipVisionEmbeddings(nn.Module):
    """Patches (a biased convolution) plus a learned position embedding per patch."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size)
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.num_patches:
            raise ValueError(f"{patches.shape[1]} patches, the SigLIP tower expects {self.num_patches}")
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """Pixels ``[N, C, H, W]`` -> the last layer's normed hidden states ``[N, patches, hidden]``; with a
    ``feature_layer`` (LLaVA-OneVision's ``vision_feature_layer``), that entry of transformers' ``hidden_states``
    (0: the embeddings, -1: the last layer's output), not normed. ``embeddings``: another family's in place of
    SigLIP's (SigLIP2's variable-resolution ones: siglip2.py)."""

    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype, feature_layer: int | None = None,
                 embeddings: nn.Module | None = None) -> None:
        super().__init__()
        self.embeddings = (SiglipVisionEmbeddings(cfg) if embeddings is None else embeddings).to(dtype)
        self.encoder = CLIPEncoder(cfg, tp, dtype)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        layers = cfg.num_hidden_layers
        self.num_layers_run = layers if feature_layer is None else feature_layer % (layers + 1)
        self.normed = feature_layer is None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers[: self.num_layers_run]:
            hidden = layer(hidden)
        return self.post_layernorm(hidden) if self.normed else hidden
