"""Llama 4's vision model (``Llama4VisionModel``) and projector: tiles of ``image_size`` pixels -> text-width rows.

- Patches: each ``patch_size`` square unfolded channel by channel (``torch.nn.Unfold``'s order) through a bias-free
  linear; a class embedding appended after the patches (last, not first), learned positions added, LayerNorm.
- Layers: pre-LayerNorm attention (biased q/k/v/o, every token attends to every other) and a GELU MLP. q and k turn
  by a 2D rotary over interleaved pairs: the first quarter of the head's pairs by the patch's column + 1, the
  second by its row + 1 (frequencies ``rope_theta ** (-2j / (head_dim / 2))``); the class token does not turn.
- Out: LayerNorm, the class token dropped, the patches pixel-shuffled (each 2 x 2 block one feature, for
  ``pixel_shuffle_ratio`` 0.5: two columns then two rows merged, transformers' channel order), the adapter MLP
  (``fc1``, GELU, ``fc2``, GELU; no biases), then the multi-modal projector's bias-free ``linear_1`` to the text
  width. transformers hard-codes the exact GELU in the tower whatever ``hidden_act`` says, and so does this.

The tower is whole on every tensor-parallel rank (``mm_encoder_tp_mode`` "weights" or "data").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError

__all__ = ["Llama4MultiModalProjector", "Llama4VisionModel", "llama4_pixel_shuffle", "vision_rotary_table"]


def vision_rotary_table(side: int, head_dim: int, theta: float) -> torch.Tensor:
    """``[side * side + 1, head_dim / 2]`` float32 angles of each patch's pairs (row-major patches, then the class
    token's zeros): the first ``head_dim / 4`` pairs by column + 1, the rest by row + 1."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2)[:quarter].float() / (head_dim // 2)))
    index = torch.arange(side * side, dtype=torch.int32)
    cols, rows = (index % side + 1)[:, None], (index // side + 1)[:, None]
    angles = torch.cat([cols * inv_freq[None], rows * inv_freq[None]], dim=-1)
    return torch.cat([angles, angles.new_zeros(1, angles.shape[-1])])


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, L, heads, D]`` with each interleaved pair (2i, 2i + 1) turned by its angle, in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    turned = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return turned.flatten(-2).type_as(x)


def llama4_pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``[N, side * side, D]`` -> ``[N, (side / factor)^2, D * factor^2]``: ``factor`` neighbouring columns merged
    into one feature, then ``factor`` neighbouring rows of those (transformers' Llama 4 order)."""
    n, count, dim = x.shape
    side = int(round(count ** 0.5))
    x = x.view(n, side, side // factor, dim * factor).transpose(1, 2)
    x = x.reshape(n, side // factor, side // factor, dim * factor * factor).transpose(1, 2)
    return x.reshape(n, -1, dim * factor * factor)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, dtype=dtype) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:2], self.heads, -1)
        q = _rotate_pairs(self.q_proj(x).view(shape), cos, sin)
        k = _rotate_pairs(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).flatten(2))


class _Layer(nn.Module):
    def __init__(self, vision: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width = vision.hidden_size
        self.input_layernorm = nn.LayerNorm(width, eps=vision.norm_eps, dtype=dtype)
        self.self_attn = _Attention(width, vision.num_attention_heads, dtype)
        self.post_attention_layernorm = nn.LayerNorm(width, eps=vision.norm_eps, dtype=dtype)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(width, vision.intermediate_size, dtype=dtype)
        self.mlp.act = nn.GELU()
        self.mlp.fc2 = nn.Linear(vision.intermediate_size, width, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Adapter(nn.Module):
    """``fc1``, GELU, ``fc2``, GELU over the pixel-shuffled patches (``vision_adapter.mlp``)."""

    def __init__(self, vision: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision.intermediate_size, vision.projector_input_dim, bias=False, dtype=dtype)
        self.fc2 = nn.Linear(vision.projector_output_dim, vision.projector_output_dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


def _shuffle_factor(vision: Any) -> int:
    factor = round(1 / float(vision.pixel_shuffle_ratio))
    side = vision.image_size // vision.patch_size
    if abs(factor * float(vision.pixel_shuffle_ratio) - 1) > 1e-6 or side % factor:
        raise NotBuiltError("vision_config.pixel_shuffle_ratio", vision.pixel_shuffle_ratio,
                            f"1 / n for an n that divides the {side} patches a side")
    return factor


class Llama4VisionModel(nn.Module):
    """transformers' ``Llama4VisionModel`` (its parameter names): ``[N, 3, S, S]`` tiles -> ``[N, (S / patch /
    factor)^2, projector_output_dim]``."""

    def __init__(self, vision: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width, patch, side = vision.hidden_size, vision.patch_size, vision.image_size // vision.patch_size
        self.factor = _shuffle_factor(vision)
        self.patch_size = patch
        self.patch_embedding = nn.Module()
        self.patch_embedding.linear = nn.Linear(vision.num_channels * patch * patch, width, bias=False, dtype=dtype)
        self.class_embedding = nn.Parameter(torch.empty(width, dtype=dtype))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(side * side + 1, width, dtype=dtype))
        self.layernorm_pre = nn.LayerNorm(width, eps=vision.norm_eps, dtype=dtype)
        self.layernorm_post = nn.LayerNorm(width, eps=vision.norm_eps, dtype=dtype)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_Layer(vision, dtype) for _ in range(vision.num_hidden_layers))
        self.vision_adapter = nn.Module()
        self.vision_adapter.mlp = _Adapter(vision, dtype)
        theta = float((getattr(vision, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        angles = vision_rotary_table(side, width // vision.num_attention_heads, theta)
        self.register_buffer("rotary_cos", angles.cos()[:, None], persistent=False)
        self.register_buffer("rotary_sin", angles.sin()[:, None], persistent=False)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(tiles.to(self.class_embedding.dtype), self.patch_size, stride=self.patch_size)
        x = self.patch_embedding.linear(patches.transpose(1, 2))
        x = torch.cat([x, self.class_embedding.expand(x.shape[0], 1, -1)], dim=1) + self.positional_embedding_vlm
        x = self.layernorm_pre(x)
        for layer in self.model.layers:
            x = layer(x, self.rotary_cos, self.rotary_sin)
        x = self.layernorm_post(x)[:, :-1]
        return self.vision_adapter.mlp(llama4_pixel_shuffle(x, self.factor))


class Llama4MultiModalProjector(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(hf_config.vision_config.vision_output_dim, hf_config.text_config.hidden_size,
                                  bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)
