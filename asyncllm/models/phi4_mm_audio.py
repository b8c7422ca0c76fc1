"""Phi-4-multimodal's audio encoder (transformers' ``Phi4MultimodalAudioEmbedding``), names as in its checkpoint.

Log-mel frames (``Phi4MultimodalFeatureExtractor``'s 80 bins, 10 ms apart) are normalized by the checkpoint's
``global_mean`` / ``global_invstd``, subsampled ``time_reduction`` (8) times by NeMo's strided convolutions, then run
through conformer blocks (half-step feed-forward, self-attention with a learned relative-position bias per head,
a GLU + depthwise convolution module, half-step feed-forward, LayerNorm). An audio longer than 500 rows after the
subsampling is cut into 500-row chunks (the last padded with zero rows) that attend within themselves, as
transformers does. transformers adds its boolean attention mask to the scores as 1.0 / 0.0 (not as -inf): that is
kept, so a chunk's padding rows are attended to as transformers attends to them. Each audio is encoded alone (its
own padding only: transformers pads several audios of one prompt to the longest and does not mask that padding out).

The rows go through one of two projections (up, GELU, down): ``*_for_speech``, or ``*_for_vision_speech`` when the
audio's prompt holds an image too (transformers' ``audio_projection_mode``); the audio's item carries that choice
(its last feature column: 1.0 with images) and its key does too (asyncllm/mm/media_items.py: ``mm_audio_with_images``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.models.clip import activation

__all__ = ["Phi4AudioEmbedding", "audio_rows"]

_CHUNK = 500
"""Rows per attention chunk (transformers' ``max_seq_len``)."""


def audio_rows(audio_config: Any, frames: int) -> int:
    """Encoder rows of ``frames`` log-mel frames: ``ceil(frames / time_reduction)``."""
    return math.ceil(frames / int(audio_config.time_reduction))


class _Mlp(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, dtype=dtype)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size * 2, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.act = activation(cfg.activation, "audio_config.activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.gate_up_proj(self.layer_norm(x)).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))


class _Attention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = int(cfg.num_attention_heads)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=bias.to(x.dtype))
        return self.o_proj(out.transpose(1, 2).reshape(n, length, -1))


class _Glu(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.out = int(cfg.ext_pw_out_channel)
        self.ext_pw_conv_1d = nn.Conv1d(cfg.hidden_size, self.out * 2, 1, dtype=dtype)
        self.act = activation(cfg.conv_glu_type, "audio_config.conv_glu_type")
        self.b1 = nn.Parameter(torch.zeros(1, self.out, 1, dtype=dtype))
        self.b2 = nn.Parameter(torch.zeros(1, self.out, 1, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ext_pw_conv_1d(x.transpose(1, 2))
        return ((x[:, :self.out] + self.b1) * self.act(x[:, self.out:] + self.b2)).transpose(1, 2)


class _DepthwiseSeparable(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = cfg.hidden_size, cfg.hidden_size * cfg.depthwise_multiplier
        self.dw_conv = nn.Conv1d(hidden, inner, cfg.kernel_size, padding=cfg.kernel_size - 1, groups=hidden,
                                 dtype=dtype)
        self.pw_conv = nn.Conv1d(inner, cfg.depthwise_separable_out_channel, 1, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pw_conv(self.dw_conv(x))


class _ConvModule(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernel = int(cfg.kernel_size)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, dtype=dtype)
        self.glu = _Glu(cfg, dtype)
        self.dw_sep_conv_1d = _DepthwiseSeparable(cfg, dtype)
        self.act = activation(cfg.conv_activation, "audio_config.conv_activation")
        self.ext_pw_conv_1d = nn.Conv1d(cfg.hidden_size, cfg.ext_pw_out_channel, 1, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dw_sep_conv_1d(self.glu(self.layer_norm(x)).transpose(1, 2))
        if self.kernel > 1:  # causal: the kernel's right padding dropped
            x = x[:, :, :-(self.kernel - 1)]
        return self.ext_pw_conv_1d(self.act(x)).transpose(1, 2)


class _ConformerLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.feed_forward_in = _Mlp(cfg, dtype)
        self.self_attn = _Attention(cfg, dtype)
        self.conv = _ConvModule(cfg, dtype)
        self.feed_forward_out = _Mlp(cfg, dtype)
        self.layer_norm_att = nn.LayerNorm(cfg.hidden_size, dtype=dtype)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        residual = x + 0.5 * self.feed_forward_in(x)
        x = residual + self.self_attn(self.layer_norm_att(residual), bias)
        x = x + self.conv(x)
        return self.layer_norm(x + 0.5 * self.feed_forward_out(x))


class _Act(nn.Module):
    """An activation function as a module (a place in `_Subsampling`'s sequence, as in transformers')."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class _Subsampling(nn.Module):
    """NeMo's strided convolutions (``time_reduction`` = 2^k: a full one, then k - 1 depthwise + pointwise pairs)
    and the linear map of channels x remaining bins to the encoder's width."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        channels = int(cfg.nemo_conv_channels)
        act = _Act(activation(cfg.nemo_activation, "audio_config.nemo_activation"))
        layers: list[nn.Module] = [nn.Conv2d(1, channels, 3, 2, 1, dtype=dtype), act]
        for _ in range(int(math.log2(cfg.time_reduction)) - 1):
            layers += [nn.Conv2d(channels, channels, 3, 2, 1, groups=channels, dtype=dtype),
                       nn.Conv2d(channels, channels, 1, dtype=dtype), act]
        self.conv = nn.Sequential(*layers)
        bins = int(cfg.input_size)
        for _ in range(int(math.log2(cfg.time_reduction))):
            bins = (bins - 1) // 2 + 1
        self.out = nn.Linear(channels * bins, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x[:, None])
        return self.out(x.transpose(1, 2).flatten(2))


class _Normalize(nn.Module):
    """The checkpoint's per-bin mean and inverse deviation (transformers' buffers, in the model's dtype)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.global_mean = nn.Parameter(torch.zeros(cfg.input_size, dtype=dtype), requires_grad=False)
        self.global_invstd = nn.Parameter(torch.ones(cfg.input_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.global_mean) * self.global_invstd


class _RelativeBias(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.max_distance, self.symmetric = int(cfg.bias_max_distance), bool(cfg.bias_symmetric)
        self.buckets = self.max_distance * (1 if self.symmetric else 2)
        self.bias_values = nn.Embedding(self.buckets, cfg.num_attention_heads, dtype=dtype)

    def forward(self, length: int, device: torch.device) -> torch.Tensor:
        """``[1, heads, length, length]``."""
        positions = torch.arange(length, device=device)
        relative = (positions[None, :] - positions[:, None]).clamp(-self.max_distance, self.max_distance - 1)
        index = relative.abs() if self.symmetric else relative + self.buckets // 2
        return self.bias_values(index).permute(2, 0, 1)[None]


class _AudioEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.encoder_embedding = _Normalize(cfg, dtype)
        self.embed = _Subsampling(cfg, dtype)
        self.relative_attention_bias_layer = _RelativeBias(cfg, dtype)
        self.encoders = nn.ModuleList(_ConformerLayer(cfg, dtype) for _ in range(cfg.num_blocks))
        self.streaming = (int(cfg.chunk_size), int(cfg.left_chunk))

    def streaming_mask(self, length: int, device: torch.device) -> torch.Tensor:
        """transformers' chunked mask (``chunk_size`` rows a chunk, ``left_chunk`` chunks back; -1: everything) as
        the 1.0 / 0.0 it adds to the scores."""
        size, left = self.streaming
        starts = torch.as_tensor(np.arange(0, length, size), dtype=torch.long)
        start_pad, end_pad = F.pad(starts, (1, 0)), F.pad(starts, (0, 1), value=length)
        rows = torch.arange(length)[:, None]
        chunk = ((rows < end_pad) & (rows >= start_pad)).nonzero()[:, 1]
        lo = start_pad[(chunk - left).clamp(min=0)]
        hi = end_pad[chunk.clamp(max=len(starts))]
        cols = torch.arange(length)[None, :]
        return ((cols >= lo[:, None]) & (cols < hi[:, None])).float().to(device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, frames, bins]`` -> ``[N, rows, hidden]``."""
        x = self.embed(self.encoder_embedding(features.to(self.embed.out.weight.dtype)))
        n, rows, width = x.shape
        extra = -rows % _CHUNK if rows > _CHUNK else 0
        if rows > _CHUNK:
            x = F.pad(x, (0, 0, 0, extra)).reshape(-1, _CHUNK, width)
        length = x.shape[1]
        bias = self.streaming_mask(length, x.device)[None, None] + self.relative_attention_bias_layer(length, x.device)
        for layer in self.encoders:
            x = layer(x, bias)
        return x.reshape(n, -1, width)[:, :rows]


class Phi4AudioEmbedding(nn.Module):
    """transformers' ``Phi4MultimodalAudioEmbedding``: the encoder and its two projections."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg, hidden = hf_config.audio_config, hf_config.hidden_size
        if int(cfg.downsample_rate) != 1:
            raise NotBuiltError("audio_config.downsample_rate", cfg.downsample_rate, "1 (no row stacking)")
        self.encoder = _AudioEncoder(cfg, dtype)
        for mode in ("speech", "vision_speech"):
            setattr(self, f"up_proj_for_{mode}", nn.Linear(cfg.hidden_size, hidden, dtype=dtype))
            setattr(self, f"down_proj_for_{mode}", nn.Linear(hidden, hidden, dtype=dtype))

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        """``[N, 1, frames, bins + 1]`` audios (the last column: 1.0 when the prompt holds images) -> ``[N, rows,
        text hidden]``."""
        rows = self.encoder(values[:, 0, :, :-1])
        with_images = (values[:, 0, 0, -1] > 0.5).tolist()  # one read of the batch's modes, not one per audio
        out = []
        for i, vision in enumerate(with_images):
            mode = "vision_speech" if vision else "speech"
            up, down = getattr(self, f"up_proj_for_{mode}"), getattr(self, f"down_proj_for_{mode}")
            out.append(down(F.gelu(up(rows[i]))))
        return torch.stack(out)


def audio_values(processed: Any) -> np.ndarray:
    """One audio's feature extractor output -> ``[1, frames, bins + 1]`` float32, the mode column 0.0 (speech)."""
    features = np.asarray(processed["audio_input_features"], dtype=np.float32)
    if features.shape[1] == 0:
        raise InvalidRequestError("audio", "too short: not one whole 25 ms analysis frame")
    return np.concatenate([features, np.zeros((*features.shape[:2], 1), np.float32)], axis=-1)
