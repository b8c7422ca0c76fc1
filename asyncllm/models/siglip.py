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

import copy
from typing import Any

import torch
from torch import nn

from asyncllm.models.clip import CLIPEncoder
from asyncllm.models.layers import TensorParallel

__all__ = ["MaskedSiglipVisionEmbeddings", "SiglipVisionTower"]


class SiglipVisionEmbeddings(nn.Module):
    """Patches (a biased convolution) plus a learned position embedding per patch."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size)
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, cfg.hidden_size)

    def patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, H, W]`` pixels -> their ``[N, patches, hidden]`` patch embeddings, no positions yet."""
        return self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patches(pixel_values)
        if patches.shape[1] != self.num_patches:
            raise ValueError(f"{patches.shape[1]} patches, the SigLIP tower expects {self.num_patches}")
        return patches + self.position_embedding.weight


class MaskedSiglipVisionEmbeddings(SiglipVisionEmbeddings):
    """SigLIP's patches with transformers' Idefics3 positions over a view's real patches (Aria's and
    Phi-4-multimodal's towers): each real patch's fractional coordinates among them bucketized over the tower's
    ``image_size // patch_size`` positions a side; padding patches take position 0."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.per_side = cfg.image_size // cfg.patch_size

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``[N, C, H, W]`` views and their ``[N, rows, cols]`` bool patch masks -> ``[N, rows * cols, hidden]``."""
        n, rows, cols = patch_mask.shape
        ids = self._buckets(rows, patch_mask[:, :, 0].sum(1))[:, :, None] * self.per_side \
            + self._buckets(cols, patch_mask[:, 0, :].sum(1))[:, None, :]
        ids = torch.where(patch_mask, ids, 0).reshape(n, -1)
        return self.patches(pixel_values) + self.position_embedding(ids)

    def _buckets(self, size: int, real: torch.Tensor) -> torch.Tensor:
        """``[N, size]`` position buckets along one side of ``size`` patches, ``real`` ``[N]`` of them the view's."""
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=real.device)
        index = torch.arange(size, device=real.device, dtype=torch.float32)
        coords = torch.clamp(index[None, :] * (1.0 / real)[:, None], max=1.0 - 1e-6)
        return torch.bucketize(coords, boundaries, right=True)


class SiglipVisionTower(nn.Module):
    """Pixels ``[N, C, H, W]`` -> the last layer's normed hidden states ``[N, patches, hidden]``; with a
    ``feature_layer`` (LLaVA-OneVision's ``vision_feature_layer``), that entry of transformers' ``hidden_states``
    (0: the embeddings, -1: the last layer's output), not normed. ``embeddings``: another family's in place of
    SigLIP's (SigLIP2's variable-resolution ones: siglip2.py; `MaskedSiglipVisionEmbeddings`, which take the
    patch mask). ``build_unused=False`` builds only the layers run (and ``post_layernorm`` only when normed), so a
    checkpoint's later ones are left unread (Phi-4-multimodal)."""

    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype, feature_layer: int | None = None,
                 embeddings: nn.Module | None = None, build_unused: bool = True) -> None:
        super().__init__()
        layers = cfg.num_hidden_layers
        self.num_layers_run = layers if feature_layer is None else feature_layer % (layers + 1)
        self.normed = feature_layer is None
        self.embeddings = (SiglipVisionEmbeddings(cfg) if embeddings is None else embeddings).to(dtype)
        self.encoder = CLIPEncoder(cfg if build_unused else _with_layers(cfg, self.num_layers_run), tp, dtype)
        self.post_layernorm = (nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
                               if build_unused or self.normed else None)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``patch_mask`` ``[N, rows, cols]`` bool, for masked embeddings: the views' real patches, the others left
        out of every layer's attention (None: every patch attended)."""
        if patch_mask is None:
            hidden, attend = self.embeddings(pixel_values), None
        else:
            hidden, attend = self.embeddings(pixel_values, patch_mask), patch_mask.flatten(1)[:, None, None, :]
        for layer in self.encoder.layers[: self.num_layers_run]:
            hidden = layer(hidden, attend)
        return self.post_layernorm(hidden) if self.normed else hidden


def _with_layers(cfg: Any, layers: int) -> Any:
    """A copy of ``cfg`` with ``layers`` hidden layers."""
    trimmed = copy.copy(cfg)
    trimmed.num_hidden_layers = layers
    return trimmed
