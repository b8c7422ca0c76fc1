"""Gemma 4's audio tower (transformers' ``Gemma4AudioModel``, a Universal-Speech-Model conformer) in plain torch,
whole on every rank; its embedder into the decoder is `Gemma4MultimodalEmbedder` over ``output_proj_dims``.

An audio arrives as the checkpoint's ``Gemma4AudioFeatureExtractor`` log-mel frames with their mask (a frame is
real when its whole window is; the padding to 128 samples is not): ``[frames, mel]`` and ``[frames]``. Two
stride-2 3 x 3 convolutions over (time, mel), each after zeroing the padded frames and followed by a bias-free
LayerNorm over channels and a ReLU, quarter the frames; their channels x remaining mel bins are projected to the
tower's width. Each conformer layer is a half-weighted feed-forward, chunked local self-attention, a light
convolution and another half-weighted feed-forward, each clamped and RMS-normed as transformers writes them. The
attention sees, for each query, itself and the ``attention_context_left - 2`` frames before it (and
``attention_context_right - 1`` after), never a padded frame; its logits are ``q . k`` plus a relative-position
term (a sinusoid per distance, projected by ``relative_k_proj``), soft-capped by ``tanh``. transformers computes it
in blocks of ``attention_chunk_size`` queries; here it is one dense band-masked product per audio (an audio's at
most 750 rows make a small ``T x T``). A row is kept per real subsampled frame: ``mask[::2][::2].sum()`` rows.

`ConformerTower` (the layers) is Gemma 3n's too (gemma3n_audio.py, over its own subsampler), with the differences
a `ConformerVariant` names: unscaled keys, a window one frame wider each way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.gemma4 import Gemma4RMSNorm
from asyncllm.models.gemma4_vision import ClippableLinear
from asyncllm.models.layers import new_param

__all__ = ["ConformerTower", "ConformerVariant", "Gemma4AudioTower", "audio_rows"]

_NORM_EPS = 1e-6
"""transformers builds the conformer's layer and feed-forward norms with their default eps, not the config's."""
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


def audio_rows(mask: Any) -> Any:
    """Rows the tower keeps per audio: ``[N, frames]`` frame mask (a tensor or an array) -> ``[N]`` real frames
    after two halvings."""
    return mask[:, ::2][:, ::2].sum(-1)


@dataclass(frozen=True)
class ConformerVariant:
    """How a USM conformer's attention differs between Gemma 4 (the default) and Gemma 3n (``gemma3n=True``)."""

    gemma3n: bool = False
    """Gemma 3n: keys unscaled; a query attends ``context_left - 1`` frames back and ``context_right`` ahead (Gemma 4:
    one fewer each way); the relative table holds the distances ``context_left - 1`` down to ``-context_right``
    (Gemma 4: ``(chunk + context_left - 1 + context_right) // 2`` down to 0)."""

    @property
    def key_scale(self) -> float:
        return 1.0 if self.gemma3n else math.log(1 + math.e) / math.log(2)

    def window(self, cfg: Any) -> tuple[int, int]:
        """(past, future) for `_allowed`."""
        wider = int(self.gemma3n)
        return cfg.attention_context_left - 1 + wider, cfg.attention_context_right + wider

    def distances(self, cfg: Any) -> tuple[int, int]:
        """The relative table's first (farthest back) and last distances."""
        if self.gemma3n:
            return cfg.attention_context_left - 1, -cfg.attention_context_right
        return (cfg.attention_chunk_size + cfg.attention_context_left - 1 + cfg.attention_context_right) // 2, 0


def _allowed(kept: torch.Tensor, past: int, future: int) -> torch.Tensor:
    """``[N, 1, T, T]`` (query, key): a key is attended when it is real and fewer than ``past`` frames back or
    ``future`` ahead (Gemma 4: transformers' sliding mask of ``(context_left - 1, context_right)``)."""
    frames = torch.arange(kept.shape[1], device=kept.device)
    back = frames[:, None] - frames[None, :]
    window = ((back >= 0) & (back < past)) | ((back < 0) & (-back < future))
    return (window[None] & kept[:, None, :])[:, None]


def _clamp(x: torch.Tensor, bound: float) -> torch.Tensor:
    """transformers' ``gradient_clipping`` clamp, bounded by the dtype's range."""
    bound = min(bound, torch.finfo(x.dtype).max)
    return torch.clamp(x, -bound, bound)


class _SubsampleBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, stride=2, padding=1, bias=False, dtype=dtype)
        self.norm = nn.LayerNorm(channels_out, eps=eps, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, C, T, mel]``, ``mask`` ``[N, T]`` -> half the frames and bins, and their mask."""
        x = self.conv((x * mask[:, None, :, None]).to(self.conv.weight.dtype))
        return F.relu(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2), mask[:, ::2]


class _Subsampler(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        first, second = cfg.subsampling_conv_channels
        self.layer0 = _SubsampleBlock(1, first, cfg.rms_norm_eps, dtype)
        self.layer1 = _SubsampleBlock(first, second, cfg.rms_norm_eps, dtype)
        self.input_proj_linear = nn.Module()
        self.input_proj_linear.weight = new_param(cfg.hidden_size, (first // 4) * second, dtype=dtype)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = self.layer1(*self.layer0(features.unsqueeze(1), mask))
        n, _, frames, _ = x.shape
        return F.linear(x.permute(0, 2, 3, 1).reshape(n, frames, -1), self.input_proj_linear.weight), mask


class _FeedForward(nn.Module):
    def __init__(self, cfg: Any, act: Any, dtype: torch.dtype) -> None:
        super().__init__()
        clipped, hidden = bool(cfg.use_clipped_linears), cfg.hidden_size
        self.ffw_layer_1 = ClippableLinear(hidden, 4 * hidden, clipped, dtype)
        self.ffw_layer_2 = ClippableLinear(4 * hidden, hidden, clipped, dtype)
        self.pre_layer_norm = Gemma4RMSNorm(hidden, _NORM_EPS, dtype)
        self.post_layer_norm = Gemma4RMSNorm(hidden, _NORM_EPS, dtype)
        self.act, self.clip, self.weight = act, cfg.gradient_clipping, cfg.residual_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ffw_layer_2(self.act(self.ffw_layer_1(self.pre_layer_norm(_clamp(x, self.clip)))))
        return x + self.post_layer_norm(_clamp(y, self.clip)) * self.weight


class _LightConv(nn.Module):
    """A GLU, a causal depthwise convolution over the frames, a norm and the activation, as a residual."""

    def __init__(self, cfg: Any, act: Any, dtype: torch.dtype) -> None:
        super().__init__()
        clipped, hidden = bool(cfg.use_clipped_linears), cfg.hidden_size
        self.linear_start = ClippableLinear(hidden, 2 * hidden, clipped, dtype)
        self.linear_end = ClippableLinear(hidden, hidden, clipped, dtype)
        self.depthwise_conv1d = nn.Module()
        self.depthwise_conv1d.weight = new_param(hidden, 1, cfg.conv_kernel_size, dtype=dtype)
        self.pre_layer_norm = Gemma4RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.conv_norm = Gemma4RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.act, self.clip = act, cfg.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1).transpose(1, 2)
        weight = self.depthwise_conv1d.weight
        y = F.conv1d(F.pad(y, (weight.shape[-1] - 1, 0)), weight, groups=weight.shape[0]).transpose(1, 2)
        return x + self.linear_end(self.act(self.conv_norm(_clamp(y, self.clip))))


class _Attention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, variant: ConformerVariant) -> None:
        super().__init__()
        clipped, hidden = bool(cfg.use_clipped_linears), cfg.hidden_size
        self.heads, self.head_dim = cfg.num_attention_heads, hidden // cfg.num_attention_heads
        for name in ("q_proj", "k_proj", "v_proj", "post"):
            setattr(self, name, ClippableLinear(hidden, hidden, clipped, dtype))
        self.relative_k_proj = nn.Module()
        self.relative_k_proj.weight = new_param(hidden, hidden, dtype=dtype)
        self.per_dim_scale = new_param(self.head_dim, dtype=dtype)
        self.q_scale = self.head_dim**-0.5 / math.log(2)
        self.k_scale = variant.key_scale
        self.cap, self.invalid = float(cfg.attention_logit_cap), float(cfg.attention_invalid_logits_value)
        self.past = cfg.attention_context_left - 1
        """A query's block context reaches this many frames back: a key ``d`` frames back takes the relative
        table's row ``past - d``."""
        first, last = variant.distances(cfg)
        self.farthest = first - last
        """The table's last row (row 0: its farthest distance back)."""

    def forward(self, x: torch.Tensor, sinusoids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, T, D]``; ``sinusoids`` ``[farthest + 1, D]``; ``allowed`` ``[N, 1, T, T]`` (query, key)."""
        n, t, _ = x.shape
        q = self.q_proj(x).float().view(n, t, self.heads, -1) * self.q_scale * F.softplus(self.per_dim_scale.float())
        k = self.k_proj(x).float().view(n, t, self.heads, -1) * self.k_scale
        v = self.v_proj(x).float().view(n, t, self.heads, -1)
        logits = torch.einsum("nqhd,nkhd->nhqk", q, k) + self._relative(q, sinusoids)
        logits = torch.tanh(logits / self.cap) * self.cap
        probs = torch.softmax(logits.masked_fill(~allowed, self.invalid), dim=-1, dtype=torch.float32)
        out = torch.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, t, -1)
        return self.post(out.to(x.dtype))

    def _relative(self, q: torch.Tensor, sinusoids: torch.Tensor) -> torch.Tensor:
        """``[N, H, T, T]``: each query times the projected sinusoid at index ``past - (q - k)`` (zero past the
        table), as transformers' blocked relative shift lays them out."""
        table = F.linear(sinusoids, self.relative_k_proj.weight).view(-1, self.heads, self.head_dim).float()
        by_index = torch.einsum("nqhd,jhd->nhqj", q, table)
        by_index = F.pad(by_index, (0, 1))  # the last column: zero, for indices off the table
        t = q.shape[1]
        frames = torch.arange(t, device=q.device)
        index = self.past + frames[None, :] - frames[:, None]
        index = torch.where((index >= 0) & (index <= self.farthest), index, self.farthest + 1)
        return torch.gather(by_index, -1, index.expand(*by_index.shape[:2], t, t))



class _ConformerLayer(nn.Module):
    def __init__(self, cfg: Any, act: Any, dtype: torch.dtype, variant: ConformerVariant) -> None:
        super().__init__()
        self.feed_forward1 = _FeedForward(cfg, act, dtype)
        self.feed_forward2 = _FeedForward(cfg, act, dtype)
        self.self_attn = _Attention(cfg, dtype, variant)
        self.lconv1d = _LightConv(cfg, act, dtype)
        for name in ("norm_pre_attn", "norm_post_attn", "norm_out"):
            setattr(self, name, Gemma4RMSNorm(cfg.hidden_size, _NORM_EPS, dtype))
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor, sinusoids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = self.feed_forward1(x)
        attended = self.self_attn(self.norm_pre_attn(_clamp(x, self.clip)), sinusoids, allowed)
        x = self.lconv1d(x + self.norm_post_attn(_clamp(attended, self.clip)))
        return self.norm_out(_clamp(self.feed_forward2(x), self.clip))


class ConformerTower(nn.Module):
    """The conformer layers over a subsampler's frames (`encode`: ``[N, frames, mel]`` log-mel features and
    ``[N, frames]`` masks -> ``[N, frames / 4, hidden]`` and the subsampled mask)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, subsampler: nn.Module,
                 variant: ConformerVariant = ConformerVariant()) -> None:
        super().__init__()
        act = _ACTIVATIONS.get(cfg.hidden_act)
        if act is None:
            raise NotBuiltError("audio_config.hidden_act", cfg.hidden_act, f"one of {', '.join(_ACTIVATIONS)}")
        self.subsample_conv_projection = subsampler
        self.layers = nn.ModuleList(_ConformerLayer(cfg, act, dtype, variant) for _ in range(cfg.num_hidden_layers))
        self.past, self.future = variant.window(cfg)
        first, last = variant.distances(cfg)
        self.register_buffer("distances", torch.arange(first, last - 1, -1, dtype=torch.float32,
                                                       device=torch.get_default_device()), persistent=False)
        count = cfg.hidden_size // 2
        steps = torch.arange(count, dtype=torch.float32, device=torch.get_default_device())
        self.register_buffer("inv_timescales", torch.exp(-steps * math.log(10000.0) / max(count - 1, 1)),
                             persistent=False)

    def encode(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, kept = self.subsample_conv_projection(features, mask)
        angles = self.distances[:, None] * self.inv_timescales
        sinusoids = torch.cat([angles.sin(), angles.cos()], dim=-1).to(x.dtype)
        allowed = _allowed(kept, self.past, self.future)
        for layer in self.layers:
            x = layer(x, sinusoids, allowed)
        return x, kept


class Gemma4AudioTower(ConformerTower):
    """``[N, frames, mel]`` log-mel features and ``[N, frames]`` masks -> ``[N, frames / 4, output_proj_dims]`` (the
    rows past `audio_rows` are padding)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        if len(cfg.subsampling_conv_channels) != 2:
            raise NotBuiltError("audio_config.subsampling_conv_channels", cfg.subsampling_conv_channels,
                                "two convolutions, as Gemma 4's tower")
        super().__init__(cfg, dtype, _Subsampler(cfg, dtype))
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True, dtype=dtype)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output_proj(self.encode(features, mask)[0])
