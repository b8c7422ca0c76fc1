"""SigLIP2's NaFlex vision tower (LFM2-VL's image encoder): variable resolution, one image per batch row.

SigLIP's tower (siglip.py: CLIP's encoder layers, ``post_layernorm``) with other embeddings: each
``encoder_patch_size`` patch arrives flattened (its pixels row by row, channels last) and is embedded by a linear
map (``patch_embedding``, a ``Linear`` where SigLIP has a convolution); the learned position table, a square grid
of ``num_patches`` entries, is resized to the image's patch rows x cols (bilinear, antialiased, in float32, as
transformers resizes it) and added. transformers pads a batch of images to one patch count and masks the padding;
here a batch holds images of one shape (asyncllm/mm/embeddings.py batches items by shape), so nothing is padded and
every patch attends to every other. The pooling head (``vision_use_head``) is not built: LFM2-VL uses the patches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.siglip import SiglipVisionTower

__all__ = ["Siglip2VisionTower"]


class Siglip2VisionEmbeddings(nn.Module):
    """Flattened patches ``[N, rows, cols, C * p * p]`` -> ``[N, rows * cols, hidden]`` with resized positions."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size)
        self.grid = int(cfg.num_patches ** 0.5)
        if self.grid * self.grid != cfg.num_patches:
            raise NotBuiltError("vision_config.num_patches", cfg.num_patches, "a SigLIP2 position table that is "
                                                                              "not a square grid")
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """The position table resized to ``rows x cols`` patches, row by row: ``[rows * cols, hidden]``."""
        table = self.position_embedding.weight
        grid = table.reshape(self.grid, self.grid, -1).permute(2, 0, 1)[None].float()
        resized = F.interpolate(grid, size=(rows, cols), mode="bilinear", align_corners=False, antialias=True)
        return resized[0].flatten(1).transpose(0, 1).to(table.dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, rows, cols, _ = patches.shape
        embedded = self.patch_embedding(patches.flatten(1, 2).to(self.patch_embedding.weight.dtype))
        return embedded + self.positions(rows, cols)


class Siglip2VisionTower(SiglipVisionTower):
    """``[N, rows, cols, C * p * p]`` patches of images of one shape -> ``[N, rows * cols, hidden]``, normed."""

    def __init__(self, cfg: Any, tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__(cfg, tp, dtype, embeddings=Siglip2VisionEmbeddings(cfg))
