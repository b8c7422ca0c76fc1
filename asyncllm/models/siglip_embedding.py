"""SigLIP as an embedding model (``SiglipModel``: google/siglip-*), as vLLM's ``SiglipEmbeddingModel`` serves it:
CLIP's text-or-image prompts (asyncllm/models/clip_embedding.py) with SigLIP's ends.

Text: the same layers under the same names as CLIP's text transformer, but every prompt token attends to every
other (no causal mask): a text prompt carries one item of no rows spanning it, ``bidirectional`` (as PaliGemma's
prefix), so the scheduler prefills it in one chunk and the attention backends let each row see the prompt's last
position; the prefix cache keys each block by the whole prompt. The pooled row is the last (transformers'
``pooler_output``: ``last_hidden_state[:, -1]``) through the text ``head`` (a biased linear to
``projection_size``). The prompt is taken as tokenized, as vLLM does: SigLIP was trained on texts padded to 64
tokens (transformers' model cards pad with ``padding="max_length"``); send such ids as ``prompt_token_ids`` to embed
them padded. Image: the SigLIP tower (asyncllm/models/siglip.py), its ``post_layernorm``, and the attention-pooling
head (a learned probe attending over the patches, a LayerNorm and an MLP): ``get_image_features``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.clip import CLIPMLP
from asyncllm.models.clip_embedding import CLIPEmbeddingModel
from asyncllm.models.layers import TensorParallel
from asyncllm.models.siglip import SiglipVisionTower
from asyncllm.protocol import MultiModalItem

__all__ = ["SiglipEmbeddingModel"]

_TEXT_SPAN = "siglip-text"
"""A text prompt's item key (it holds no data; the prefix cache keys the span by its content)."""


class SiglipPoolingHead(nn.Module):
    """transformers' ``SiglipMultiheadAttentionPoolingHead``: ``probe`` attends over the patches (torch's
    multi-head attention, whole on every rank), then a residual MLP after a LayerNorm; the probe's row."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.attention = nn.MultiheadAttention(cfg.hidden_size, cfg.num_attention_heads, batch_first=True,
                                               dtype=dtype)
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(cfg, TensorParallel(), dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        probe = self.probe.expand(patches.shape[0], 1, -1)
        pooled = self.attention(probe, patches, patches, need_weights=False)[0]
        return (pooled + self.mlp(self.layernorm(pooled)))[:, 0]


class SiglipEmbeddingModel(CLIPEmbeddingModel):
    """``SiglipModel``: bidirectional text through its ``head``, images through the tower's attention-pooling head;
    ``projection_size``-wide rows (the vision width, which they must equal)."""

    text_head_bias = True
    family = "SigLIP"

    @staticmethod
    def embedding_width(hf_config: Any) -> int:
        """The text head's ``projection_size``, which the image side's width (the tower's hidden size) must equal."""
        width = int(getattr(hf_config.text_config, "projection_size", None) or hf_config.text_config.hidden_size)
        if width != hf_config.vision_config.hidden_size:
            raise ConfigError("text_config.projection_size", width, f"the vision tower's hidden_size "
                                                                    f"{hf_config.vision_config.hidden_size}")
        return width

    def build_vision(self, hf_config: Any, encoder_tp: TensorParallel, dtype: torch.dtype) -> None:
        vision = hf_config.vision_config
        if not getattr(vision, "vision_use_head", True):
            raise NotBuiltError("vision_config.vision_use_head", False, "SigLIP image embeddings without the "
                                                                       "attention-pooling head")
        self.vision_tower = SiglipVisionTower(vision, encoder_tp, dtype)
        self.vision_head = SiglipPoolingHead(vision, dtype)

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision_head(self.vision_tower(pixel_values))

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """CLIP's mapping, with the text ``head`` as ``text_projection`` and the tower's ``head`` as
        ``vision_head``."""
        if name.startswith("text_model.head."):
            return "text_projection." + name.removeprefix("text_model.head.")
        if name.startswith("vision_model.head."):
            return "vision_head." + name.removeprefix("vision_model.head.")
        return CLIPEmbeddingModel.checkpoint_name(name)

    @staticmethod
    def mm_prompt_items(hf_config: Any, token_ids: list[int], items: list[MultiModalItem]) -> list[MultiModalItem]:
        """A text prompt as one span of no rows, both ways over all its tokens; an image prompt's item as it is."""
        return items or [MultiModalItem(_TEXT_SPAN, 0, 0, b"", [0], bidirectional=[0, len(token_ids)])]

