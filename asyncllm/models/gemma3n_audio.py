"""Gemma 3n's audio tower (transformers' ``Gemma3nAudioEncoder``, a Universal-Speech-Model conformer) and its
multimodal embedders, in plain torch, whole on every rank.

The conformer layers are Gemma 4's (gemma4_audio.py's `ConformerTower`, under the `ConformerVariant` of Gemma 3n:
keys unscaled, each query attending ``conf_attention_context_left - 1`` frames back and
``conf_attention_context_right`` ahead, the relative table over exactly those distances). What is Gemma 3n's own:

- The subsampler: two convolutions (``sscp_conv_kernel_size`` / ``sscp_conv_stride_size``, 3 x 3 stride 2 in the
  releases) over (time, mel), each padded by one bin on both mel sides and ``kernel - 1`` frames after the audio
  (none before), then a *cumulative* group norm (each frame normed by the mean and variance of every channel and bin
  of the frames up to it, ``sscp_conv_group_norm_eps``, a scale per channel) and a ReLU; no frame is zeroed. The
  mask keeps every ``stride``-th frame (transformers' gather at ``t x stride``).
- After the layers every ``conf_reduction_factor``-th row is kept (4: a 30 s audio, 3000 frames, makes 188 rows) and
  there is no output projection.
- The embedder (``Gemma3nMultimodalEmbedder``): a soft row is RMS-normed with weights, projected to the decoder's
  width and normed again without; a token id in the embedder's range (``vocab_offset``, ``vocab_size`` rows) is
  looked up in its own table, normed with weights, projected and normed.

The checkpoint names its layers ``conformer.{i}.ffw_layer_start`` / ``attention`` / ``lconv1d`` / ``ffw_layer_end``
/ ``norm``: `gemma3n_audio_name` maps them to the conformer's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.gemma4 import Gemma4RMSNorm, gemma4_rms_norm
from asyncllm.models.gemma4_audio import ConformerTower, ConformerVariant
from asyncllm.models.layers import new_param

__all__ = ["Gemma3nAudioTower", "Gemma3nMultimodalEmbedder", "gemma3n_audio_name"]

_LAYER_PARTS = (("ffw_layer_start.", "feed_forward1."), ("ffw_layer_end.", "feed_forward2."),
                ("attention.pre_attn_norm.", "norm_pre_attn."), ("attention.post_norm.", "norm_post_attn."),
                ("attention.attn.relative_position_embedding.pos_proj.", "self_attn.relative_k_proj."),
                ("attention.attn.", "self_attn."), ("attention.post.", "self_attn.post."), ("norm.", "norm_out."))
"""A Gemma 3n conformer layer's checkpoint module -> the conformer's (gemma4_audio.py), the first match."""
_PROJECTIONS = ("ffw_layer_1", "ffw_layer_2", "q_proj", "k_proj", "v_proj", "post", "linear_start", "linear_end")
"""Its projections, which the conformer holds as ``ClippableLinear``s (unclipped here): ``.linear.weight``."""


def gemma3n_audio_name(name: str) -> str:
    """A checkpoint name under ``audio_tower.`` as the tower names it (``conformer.3.attention.attn.q_proj.weight``
    -> ``layers.3.self_attn.q_proj.linear.weight``); the subsampler's unchanged."""
    if not name.startswith("conformer."):
        return name
    index, part = name.removeprefix("conformer.").split(".", 1)
    for theirs, ours in _LAYER_PARTS:
        if part.startswith(theirs):
            part = ours + part.removeprefix(theirs)
            break
    module, leaf = part.rsplit(".", 1)
    if leaf == "weight" and module.rsplit(".", 1)[-1] in _PROJECTIONS:
        part = f"{module}.linear.weight"
    return f"layers.{index}.{part}"


def _conformer_fields(cfg: Any) -> SimpleNamespace:
    """Gemma 3n's audio config under the names the conformer reads (Gemma 4's)."""
    return SimpleNamespace(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.conf_num_hidden_layers,
        num_attention_heads=cfg.conf_num_attention_heads, attention_chunk_size=cfg.conf_attention_chunk_size,
        attention_context_left=cfg.conf_attention_context_left,
        attention_context_right=cfg.conf_attention_context_right, attention_logit_cap=cfg.conf_attention_logit_cap,
        attention_invalid_logits_value=torch.finfo(torch.float32).min, conv_kernel_size=cfg.conf_conv_kernel_size,
        residual_weight=cfg.conf_residual_weight, gradient_clipping=cfg.gradient_clipping,
        rms_norm_eps=cfg.rms_norm_eps, use_clipped_linears=False, hidden_act="silu")


def _cumulative_group_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``[N, T, mel, C]``: each frame less the running mean of every value up to it, over the root of the
    running mean of its squared deviations (each frame's from its own running mean), times the channel's scale; in
    float32, as transformers' ``Gemma3nAudioCumulativeGroupNorm``."""
    x32 = x.float()
    per_frame = x32[0, 0].numel()
    count = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=torch.float32)[None, :, None, None] * per_frame
    mean = torch.cumsum(x32.sum(dim=(2, 3), keepdim=True), dim=1) / count
    variance = torch.cumsum((x32 - mean).pow(2).sum(dim=(2, 3), keepdim=True), dim=1) / count
    return ((x32 - mean) * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)


class _ConvBlock(nn.Module):
    def __init__(self, cfg: Any, index: int, channels_in: int, dtype: torch.dtype) -> None:
        super().__init__()
        kernel, stride = tuple(cfg.sscp_conv_kernel_size[index]), tuple(cfg.sscp_conv_stride_size[index])
        channels = cfg.sscp_conv_channel_size[index]
        self.conv = nn.Conv2d(channels_in, channels, kernel, stride=stride, bias=False, dtype=dtype)
        self.norm = nn.Module()
        self.norm.weight = new_param(channels, dtype=dtype)
        self.padding = (1, 1, 0, kernel[0] - 1)  # (mel before, after, time before, after)
        self.eps, self.time_stride = cfg.sscp_conv_group_norm_eps, stride[0]

    def out_bins(self, bins: int) -> int:
        return (bins + 2 - self.conv.kernel_size[1]) // self.conv.stride[1] + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, C, T, mel]`` -> the convolved, normed frames and bins."""
        x = self.conv(F.pad(x, self.padding).to(self.conv.weight.dtype)).permute(0, 2, 3, 1)
        return F.relu(_cumulative_group_norm(x, self.norm.weight, self.eps)).permute(0, 3, 1, 2)


class _Subsampler(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if len(cfg.sscp_conv_channel_size) != 2:
            raise NotBuiltError("audio_config.sscp_conv_channel_size", cfg.sscp_conv_channel_size,
                                "two convolutions, as Gemma 3n's tower")
        self.conv_0 = _ConvBlock(cfg, 0, 1, dtype)
        self.conv_1 = _ConvBlock(cfg, 1, cfg.sscp_conv_channel_size[0], dtype)
        bins = self.conv_1.out_bins(self.conv_0.out_bins(cfg.input_feat_size))
        self.input_proj_linear = nn.Module()
        self.input_proj_linear.weight = new_param(cfg.hidden_size, bins * cfg.sscp_conv_channel_size[1], dtype=dtype)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, T, mel]`` and ``[N, T]`` (True: a real frame) -> ``[N, T', hidden]`` and the mask of each output
        frame's first input frame."""
        x = self.conv_1(self.conv_0(features.unsqueeze(1)))
        n, _, frames, _ = x.shape
        stride = self.conv_0.time_stride * self.conv_1.time_stride
        first = (torch.arange(frames, device=mask.device) * stride).clamp(max=mask.shape[1] - 1)
        x = F.linear(x.permute(0, 2, 3, 1).reshape(n, frames, -1), self.input_proj_linear.weight)
        return x, mask[:, first]


class Gemma3nAudioTower(ConformerTower):
    """``[N, frames, mel]`` log-mel features and ``[N, frames]`` masks -> ``[N, rows, hidden]`` and the rows' mask
    (True: a real row; the others are padding)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__(_conformer_fields(cfg), dtype, _Subsampler(cfg, dtype), ConformerVariant(gemma3n=True))
        self.reduction = int(cfg.conf_reduction_factor)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, kept = self.encode(features, mask)
        return x[:, :: self.reduction], kept[:, :: self.reduction]


class Gemma3nMultimodalEmbedder(nn.Module):
    """A tower's rows (`forward`) or the ids of its own token range (`embed_ids`) -> the decoder's width."""

    def __init__(self, tower: Any, text_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_offset, self.vocab_size = int(tower.vocab_offset), int(tower.vocab_size)
        self.embedding = nn.Module()
        self.embedding.weight = new_param(self.vocab_size, tower.hidden_size, dtype=dtype)
        self.hard_embedding_norm = Gemma4RMSNorm(tower.hidden_size, tower.rms_norm_eps, dtype)
        self.soft_embedding_norm = Gemma4RMSNorm(tower.hidden_size, tower.rms_norm_eps, dtype)
        self.embedding_projection = nn.Module()
        self.embedding_projection.weight = new_param(text_hidden, tower.hidden_size, dtype=dtype)
        self.eps = tower.rms_norm_eps

    def _projected(self, normed: torch.Tensor) -> torch.Tensor:
        return gemma4_rms_norm(F.linear(normed, self.embedding_projection.weight), None, self.eps)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self._projected(self.soft_embedding_norm(rows))

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids in ``[vocab_offset, vocab_offset + vocab_size)`` -> their rows."""
        return self._projected(self.hard_embedding_norm(F.embedding(input_ids - self.vocab_offset,
                                                                    self.embedding.weight)))
