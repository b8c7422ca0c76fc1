"""Pixtral's vision tower and Mistral 3's projector (Mistral-Small-3.1 / 3.2, Magistral-Small, Devstral-Small).

The tower encodes each image at its own resolution: 16 x 16 (or 14 x 14) pixel
patches through a bias-free convolution, an RMSNorm, then transformer layers
with 2-D axial rotary positions (a patch's row turns half the frequencies, its
column the other half) and attention within the image. Mistral 3's projector
normalizes the last layer's patches, merges each 2 x 2 of them into one
(``patch_merger``: a linear map of the four concatenated), and maps them to the
decoder's width through a GELU MLP.

Plain torch, whole on every rank (the tower is small next to the decoder), so
``mm_encoder_tp_mode`` "weights" and "data" differ only in which ranks encode
which images. Equal to transformers' ``PixtralVisionModel`` and
``Mistral3MultiModalProjector`` (tests/unit/test_pixtral.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.clip import activation

__all__ = ["Mistral3Projector", "PixtralVisionTower", "VisionRMSNorm"]


class VisionRMSNorm(nn.Module):
    """transformers' RMSNorm: normalized in float32, cast back, then scaled."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _linear(width_in: int, width_out: int, dtype: torch.dtype, bias: bool = False) -> nn.Linear:
    return nn.Linear(width_in, width_out, bias=bias, dtype=dtype)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_linear(width, width, dtype) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[B, N, width]`` (one image per row of the batch) -> the same."""
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, self.heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (t * cos + torch.cat((-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]), -1) * sin for t in (q, k))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class _MLP(nn.Module):
    def __init__(self, width: int, inner: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(width, inner, dtype), _linear(width, inner, dtype)
        self.down_proj = _linear(inner, width, dtype)
        self.act = activation(act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention_norm = VisionRMSNorm(config.hidden_size, 1e-5, dtype)
        self.attention = _Attention(config.hidden_size, config.num_attention_heads, dtype)
        self.ffn_norm = VisionRMSNorm(config.hidden_size, 1e-5, dtype)
        self.feed_forward = _MLP(config.hidden_size, config.intermediate_size, config.hidden_act, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):
    def __init__(self, config: Any, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(config, dtype) for _ in range(num_layers))


def _feature_layers(config: Any, feature_layer: Any) -> int:
    """How many layers run: transformers' ``hidden_states[feature_layer]`` (0 = the embeddings, -1 = the last)."""
    if not isinstance(feature_layer, int):
        raise NotBuiltError("vision_feature_layer", feature_layer, "a single vision feature layer")
    total = config.num_hidden_layers
    layers = feature_layer if feature_layer >= 0 else total + 1 + feature_layer
    if not 0 <= layers <= total:
        raise NotBuiltError("vision_feature_layer", feature_layer, f"a layer of the {total}-layer tower")
    return layers


class PixtralVisionTower(nn.Module):
    """``[B, 3, H, W]`` images of one size -> ``[B, (H / patch) * (W / patch), hidden]`` patch features (the output of
    ``vision_feature_layer``), patches in row-major order."""

    def __init__(self, config: Any, feature_layer: Any, dtype: torch.dtype) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "axial") != "axial":
            raise NotBuiltError("vision_config.rope_parameters.rope_type", rope.get("rope_type"), "axial")
        self.patch_size = config.patch_size
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10_000.0)))
        self.patch_conv = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size,
                                    bias=False, dtype=dtype)
        self.ln_pre = VisionRMSNorm(config.hidden_size, 1e-5, dtype)
        self.transformer = _Transformer(config, _feature_layers(config, feature_layer), dtype)

    def rotary(self, rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[rows * cols, head_dim]`` of the patches: the row turns frequencies 0, 2, 4, ... of the
        ordinary rope's, the column 1, 3, 5, ...; the halves repeated for ``rotate_half``."""
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
        row, col = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
        angles = torch.cat([row.reshape(-1, 1).float() * inv_freq[0::2], col.reshape(-1, 1).float() * inv_freq[1::2]], -1)
        angles = torch.cat([angles, angles], -1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_conv.weight
        patches = self.patch_conv(pixel_values.to(weight.dtype))  # [B, hidden, rows, cols]
        rows, cols = patches.shape[-2:]
        x = self.ln_pre(patches.flatten(2).transpose(1, 2))
        cos, sin = self.rotary(rows, cols, x.device, x.dtype)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin)
        return x


class _PatchMerger(nn.Module):
    def __init__(self, width: int, merge: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = _linear(width * merge * merge, width, dtype)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """``[B, rows * cols, width]`` -> ``[B, rows * cols / merge**2, width]``: each merge x merge block's patches,
        channel-major as ``torch.nn.functional.unfold`` lays them out, through ``merging_layer``."""
        grid = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], rows, cols)
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)  # [B, width * merge**2, blocks]
        return self.merging_layer(blocks.transpose(1, 2))


class Mistral3Projector(nn.Module):
    """Mistral 3's ``multi_modal_projector``: RMSNorm, 2 x 2 patch merger, ``linear_1``, GELU, ``linear_2``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision, text = hf_config.vision_config.hidden_size, hf_config.text_config.hidden_size
        bias = bool(getattr(hf_config, "multimodal_projector_bias", False))
        self.norm = VisionRMSNorm(vision, hf_config.text_config.rms_norm_eps, dtype)
        self.patch_merger = _PatchMerger(vision, int(hf_config.spatial_merge_size), dtype)
        self.linear_1 = _linear(vision, text, dtype, bias)
        self.act = activation(hf_config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = _linear(text, text, dtype, bias)

    def forward(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        merged = self.patch_merger(self.norm(features), rows, cols)
        return self.linear_2(self.act(self.linear_1(merged)))
