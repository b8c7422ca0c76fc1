"""GLM-ASR (``GlmAsrForConditionalGeneration``: zai-org/GLM-ASR-Nano-2512): a Whisper-like audio encoder with rotary
attention, a two-layer projector over groups of four encoder rows, and a Llama decoder (llama.py).

The host side is Audio Flamingo 3's (qwen2_audio.py): the checkpoint's ``WhisperFeatureExtractor`` reads each audio
in consecutive 30 s windows (up to 21 of them: transformers' ``GlmAsrProcessor`` cuts audio at its
``max_audio_len`` of 655 s), each window's frames packed with their mask. The encoder: Whisper's two GELU
convolutions (shared with qwen2_audio.py), no learned positions, pre-norm layers whose attention rotates the first
``partial_rotary_factor`` of each head (NeoX halves; grouped key/value heads, no key bias) and attends to every
frame of the padded window (transformers masks nothing there), a GELU MLP, a final LayerNorm. Its rows are joined
four at a time (``audio_config.intermediate_size`` = 4 x its width) before the projector, and a window of ``L``
frames keeps its first ``((L - 1) // 2 + 1 - 4) // 4 + 1`` (`glmasr_output_length`) for its ``<|pad|>``
placeholders. The encoder is whole on every tensor-parallel rank; the decoder splits as Llama's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.qwen2_audio import (
    Qwen2AudioForConditionalGeneration, add_audio_convolutions, convolved_frames,
)
from asyncllm.models.rotary import RotaryEmbedding
from asyncllm.models.vision_language import text_config_of

__all__ = ["GlmAsrEncoder", "GlmAsrForConditionalGeneration", "glmasr_output_length"]

MERGE = 4
"""Encoder rows joined into one projector input (transformers' ``merge_factor``)."""


def glmasr_output_length(frames: int) -> int:
    """Placeholders of a window of ``frames`` mel frames: the stride-2 convolution, then groups of `MERGE` rows."""
    return ((frames - 1) // 2 + 1 - MERGE) // MERGE + 1


class GlmAsrAttention(nn.Module):
    """Bidirectional attention over a window's rows, q and k rotated by the row index."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        dim, self.heads, self.kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or dim // self.heads
        self.q_proj = nn.Linear(dim, self.heads * self.head_dim, dtype=dtype)
        self.k_proj = nn.Linear(dim, self.kv_heads * self.head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(dim, self.kv_heads * self.head_dim, dtype=dtype)
        self.o_proj = nn.Linear(self.heads * self.head_dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch * length, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch * length, self.kv_heads, self.head_dim)
        positions = torch.arange(length, device=x.device).repeat(batch)
        q, k = reference.apply_rotary(q, k, positions, cos_sin_cache)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q.view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class GlmAsrMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class GlmAsrEncoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, dtype=dtype)
        self.self_attn = GlmAsrAttention(cfg, dtype)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, dtype=dtype)
        self.mlp = GlmAsrMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GlmAsrEncoder(nn.Module):
    """Log-mel windows ``[B, mel, 3000]`` -> ``[B, 1500, hidden]`` (transformers' ``GlmAsrEncoder``)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        _check_encoder(cfg)
        add_audio_convolutions(self, cfg.num_mel_bins, cfg.hidden_size, dtype)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(cfg, head_dim, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(GlmAsrEncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = convolved_frames(self, features)
        for layer in self.layers:
            x = layer(x, self.rotary.cos_sin_cache)
        return self.norm(x)


def _check_encoder(cfg: Any) -> None:
    """`NotBuiltError` for an encoder config this file does not compute as transformers does."""
    if cfg.hidden_act != "gelu":
        raise NotBuiltError("audio_config.hidden_act", cfg.hidden_act, "'gelu'")
    if cfg.intermediate_size != MERGE * cfg.hidden_size:
        raise NotBuiltError("audio_config.intermediate_size", cfg.intermediate_size,
                            f"{MERGE} x hidden_size (the projector joins {MERGE} encoder rows)")


class GlmAsrProjector(nn.Module):
    """``linear_2(gelu(linear_1(x)))`` over `MERGE` joined encoder rows, through twice the text width."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if hf_config.projector_hidden_act != "gelu":
            raise NotBuiltError("projector_hidden_act", hf_config.projector_hidden_act, "'gelu'")
        text = text_config_of(hf_config).hidden_size
        self.linear_1 = nn.Linear(hf_config.audio_config.intermediate_size, 2 * text, dtype=dtype)
        self.linear_2 = nn.Linear(2 * text, text, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class GlmAsrForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """Audio Flamingo 3's host side and loading (qwen2_audio.py) over GLM-ASR's encoder, projector and Llama
    decoder."""

    projector_cls = GlmAsrProjector
    decoders = {"llama": LlamaForCausalLM}
    max_windows = 21
    """transformers' ``GlmAsrProcessor``: ``max_audio_len`` 655 s // 30 s windows."""

    @staticmethod
    def build_encoder(cfg: Any, dtype: torch.dtype) -> nn.Module:
        return GlmAsrEncoder(cfg, dtype)

    @staticmethod
    def audio_rows(frames: int) -> int:
        return glmasr_output_length(frames)

    def encode_windows(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """Every window's frames attended (padding included, as transformers' encoder); rows joined by `MERGE`."""
        rows = self.audio_tower(features)
        return self.multi_modal_projector(rows.reshape(rows.shape[0], -1, MERGE * rows.shape[-1]))
