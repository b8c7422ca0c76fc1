"""Gemma 4's vision tower and its embedder into the decoder (transformers' ``Gemma4VisionModel`` and
``embed_vision``), in plain torch, whole on every rank.

An image arrives as its real patches (the processor's padding rows dropped), each ``3 * patch ** 2`` pixels in
``[0, 1]`` followed by its (x, y) patch position: ``[P, 3 p^2 + 2]`` float32 (`Gemma4ForConditionalGeneration.
mm_pixel_values`). The tower scales the pixels to ``[-1, 1]``, projects them, adds a learned embedding per x and per
y, and runs its encoder layers (Gemma 4's norms; q, k and bare v norms; a 2-D rotary whose first half-head turns by
x and second by y; unscaled attention over all the image's patches; a GeGLU MLP; each linear's input and output
clipped when ``use_clipped_linears``). The pooler averages each ``k x k`` cell of patches (``pooling_kernel_size``)
and scales by ``sqrt(hidden)`` in float32, ``standardize`` subtracts and scales per feature, and the embedder norms
(no weight) and projects to the decoder's width: ``P / k^2`` rows per image.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.kernels import reference
from asyncllm.models.gemma4 import gemma4_rms_norm
from asyncllm.models.layers import new_param

__all__ = ["Gemma4VisionTower", "Gemma4MultimodalEmbedder"]


class ClippableLinear(nn.Module):
    """``clamp(clamp(x) @ W^T)`` between the checkpoint's bounds (``use_clipped_linears``), else ``x @ W^T``."""

    def __init__(self, in_features: int, out_features: int, clipped: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Module()
        self.linear.weight = new_param(out_features, in_features, dtype=dtype)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, new_param(dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        out = F.linear(x, self.linear.weight)
        return torch.clamp(out, self.output_min, self.output_max) if self.clipped else out


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma4_rms_norm(x, self.weight, self.eps)


def _rotate_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[N, P, H, D]``: its first half turned by the x angles, its second by the y ones (each half NeoX-style);
    cos / sin ``[N, P, D]`` as transformers composes them (x, x, y, y)."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    parts = [x[..., i * half:(i + 1) * half] * cos[..., i * half:(i + 1) * half]
             + reference.rotate_half(x[..., i * half:(i + 1) * half]) * sin[..., i * half:(i + 1) * half]
             for i in range(2)]
    return torch.cat(parts, dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        clipped, hidden = bool(cfg.use_clipped_linears), cfg.hidden_size
        self.q_proj = ClippableLinear(hidden, self.heads * self.head_dim, clipped, dtype)
        self.k_proj = ClippableLinear(hidden, self.kv_heads * self.head_dim, clipped, dtype)
        self.v_proj = ClippableLinear(hidden, self.kv_heads * self.head_dim, clipped, dtype)
        self.o_proj = ClippableLinear(self.heads * self.head_dim, hidden, clipped, dtype)
        self.q_norm = _Norm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = _Norm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, p, _ = x.shape
        q = _rotate_2d(self.q_norm(self.q_proj(x).view(n, p, self.heads, self.head_dim)), cos, sin)
        k = _rotate_2d(self.k_norm(self.k_proj(x).view(n, p, self.kv_heads, self.head_dim)), cos, sin)
        v = gemma4_rms_norm(self.v_proj(x).view(n, p, self.kv_heads, self.head_dim), None, self.eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.kv_heads != self.heads:
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(2, 3))  # scaling 1: the q/k norms set the scale
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(n, p, self.heads * self.head_dim)
        return self.o_proj(out)


class _MLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        clipped, hidden, inter = bool(cfg.use_clipped_linears), cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = ClippableLinear(hidden, inter, clipped, dtype)
        self.up_proj = ClippableLinear(hidden, inter, clipped, dtype)
        self.down_proj = ClippableLinear(inter, hidden, clipped, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg, dtype)
        self.mlp = _MLP(cfg, dtype)
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
        for name in names:
            setattr(self, name, _Norm(cfg.hidden_size, cfg.rms_norm_eps, dtype))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Encoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))


class _PatchEmbedder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_proj = nn.Module()
        self.input_proj.weight = new_param(cfg.hidden_size, 3 * cfg.patch_size**2, dtype=dtype)
        self.position_embedding_table = new_param(2, cfg.position_embedding_size, cfg.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = F.linear((2 * (pixels - 0.5)).to(self.input_proj.weight.dtype), self.input_proj.weight)
        table = self.position_embedding_table
        return x + (F.embedding(positions[..., 0], table[0]) + F.embedding(positions[..., 1], table[1]))


class Gemma4VisionTower(nn.Module):
    """``[N, P, 3 p^2 + 2]`` images (pixels, then x and y) -> ``[N, P / k^2, hidden]`` pooled features."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedder = _PatchEmbedder(cfg, dtype)
        self.encoder = _Encoder(cfg, dtype)
        self.kernel, self.hidden = int(cfg.pooling_kernel_size), int(cfg.hidden_size)
        self.standardize = bool(getattr(cfg, "standardize", False))
        if self.standardize:
            self.std_bias = new_param(cfg.hidden_size, dtype=dtype)
            self.std_scale = new_param(cfg.hidden_size, dtype=dtype)
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = float(params.get("rope_theta", 100.0))
        spatial = cfg.head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device="cpu") / spatial))
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' axial table: each patch's x angles twice, then its y angles twice."""
        freqs = positions[..., None].float() * self.inv_freq  # [N, P, 2, D / 4]
        x, y = freqs[..., 0, :], freqs[..., 1, :]
        angles = torch.cat([x, x, y, y], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixels, positions = images[..., :-2], images[..., -2:].round().long()
        x = self.patch_embedder(pixels, positions)
        cos, sin = self._cos_sin(positions, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        pooled = self._pool(x, positions)
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype)

    def _pool(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The mean of each ``k x k`` cell of patches, cells in row-major order, times ``sqrt(hidden)`` (float32)."""
        k = self.kernel
        length = x.shape[1] // (k * k)
        width = positions[..., 0].max(dim=-1, keepdim=True)[0] + 1
        cells = torch.div(positions, k, rounding_mode="floor")
        index = cells[..., 0] + (width // k) * cells[..., 1]
        weights = F.one_hot(index, length).float() / (k * k)
        pooled = (weights.transpose(1, 2) @ x.float()).to(x.dtype)
        return pooled.float() * self.hidden**0.5


class Gemma4MultimodalEmbedder(nn.Module):
    """transformers' ``Gemma4MultimodalEmbedder``: a weightless RMSNorm, then the projection to the text width (from
    the tower's width: the audio tower's ``output_proj_dims``)."""

    def __init__(self, tower: Any, text_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        width = getattr(tower, "output_proj_dims", None) or tower.hidden_size
        self.embedding_projection = nn.Module()
        self.embedding_projection.weight = new_param(text_hidden, width, dtype=dtype)
        self.eps = tower.rms_norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(gemma4_rms_norm(x, None, self.eps), self.embedding_projection.weight)
