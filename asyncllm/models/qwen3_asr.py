"""Qwen3-ASR (``Qwen3ASRForConditionalGeneration``: Qwen/Qwen3-ASR-0.6B-hf, -1.7B-hf): its audio encoder, a two-layer
projector and the Qwen3 decoder of qwen3.py.

The host turns each audio into the checkpoint's ``Qwen3ASRFeatureExtractor`` log-mel frames (the whole audio, no
30 s cut; at least 0.5 s), padded with zeros to whole chunks of ``2 * n_window`` frames (1 s), packed with their mask
as one ``[1, mel + 1, frames]`` float32 array (Qwen2-Audio's `mm_audio_values`). The encoder cuts them into those
chunks; three stride-2 GELU convolutions over (mel, time) turn a chunk into ``post_cnn(2 * n_window)`` rows (13)
through a linear layer, sinusoidal positions restart at every chunk, and each audio's rows (its padded ones dropped)
attend within windows of ``n_window_infer / (2 * n_window)`` chunks (8: 104 rows) through pre-norm layers (Whisper's,
with a key bias), then a LayerNorm. Each row replaces one ``<|audio_pad|>`` placeholder, after the projector
(``linear_2(gelu(linear_1(x)))``). transformers computes but never applies ``scale_embedding``; nor do we. The encoder
is whole on every tensor-parallel rank; the decoder splits as Qwen3's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.audios import post_cnn_length, qwen3_asr_output_length
from asyncllm.models.layers import TensorParallel
from asyncllm.models.qwen2_audio import AudioAttention, AudioEncoderLayer, Qwen2AudioForConditionalGeneration
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.vision_language import VisionLanguageModel, build_decoder, text_config_of

__all__ = ["Qwen3ASREncoder", "Qwen3ASRForConditionalGeneration", "kept_rows", "qwen3_asr_output_length"]


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """``[length, channels]`` float32: the sines then the cosines of ``position * max_timescale ** (-i / (half - 1))``
    (computed in float32 as the checkpoint's training did)."""
    half = channels // 2
    inv_timescales = torch.exp(-math.log(max_timescale) / (half - 1) * torch.arange(half, device="cpu").float())
    scaled = torch.arange(length, device="cpu")[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


def kept_rows(rows: torch.Tensor, frames: list[int], chunk: int) -> torch.Tensor:
    """Each audio's chunks' rows ``[audios * chunks, rows per chunk, d_model]`` (``frames`` true frames each, in
    chunks of ``chunk``) -> the rows of their true frames, packed in order."""
    chunks = rows.shape[0] // len(frames)
    kept = [post_cnn_length(min(max(n - c * chunk, 0), chunk)) for n in frames for c in range(chunks)]
    valid = torch.arange(rows.shape[1], device=rows.device)[None, :] < torch.tensor(kept, device=rows.device)[:, None]
    return rows[valid]


class Qwen3ASRAttention(AudioAttention):
    """Whisper's bidirectional attention with a key bias."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__(dim, heads, dtype)
        self.k_proj = nn.Linear(dim, dim, dtype=dtype)


class Qwen3ASREncoderLayer(AudioEncoderLayer):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        self.self_attn = Qwen3ASRAttention(cfg.d_model, cfg.encoder_attention_heads, dtype)


class Qwen3ASREncoder(nn.Module):
    """Log-mel frames ``[B, mel, chunks * 2 * n_window]`` with each audio's true frames -> each audio's
    ``[rows, d_model]`` (transformers' ``Qwen3ASREncoder``)."""

    positions_field = "max_position_embeddings"
    """The config's field that sizes the sinusoidal positions (Qwen3-Omni's: ``max_source_positions``)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        dim, layers = cfg.d_model, cfg.encoder_layers
        self.n_window, hidden = cfg.n_window, cfg.downsample_hidden_size
        chunk = 2 * cfg.n_window
        if cfg.n_window_infer < chunk or cfg.n_window_infer % chunk:
            raise ConfigError("audio_config.n_window_infer", cfg.n_window_infer, f"a multiple of 2 * n_window = {chunk}")
        self.window_rows = post_cnn_length(chunk) * (cfg.n_window_infer // chunk)
        num_positions = getattr(cfg, self.positions_field)
        if num_positions < post_cnn_length(chunk):
            raise NotBuiltError(f"audio_config.{self.positions_field}", num_positions,
                                f"at least a chunk's {post_cnn_length(chunk)} rows")
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1, dtype=dtype)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1, dtype=dtype)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1, dtype=dtype)
        self.conv_out = nn.Linear(hidden * post_cnn_length(cfg.num_mel_bins), dim, bias=False, dtype=dtype)
        positions = sinusoids(num_positions, dim)
        self.register_buffer("positions", positions.to(torch.get_default_device()), persistent=False)
        self.layers = nn.ModuleList(Qwen3ASREncoderLayer(cfg, dtype) for _ in range(layers))
        self.ln_post = nn.LayerNorm(dim, dtype=dtype)

    def _chunk_rows(self, features: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """``[B, mel, chunks * chunk]`` -> ``[B * chunks, post_cnn(chunk), d_model]``: each chunk (``2 * n_window``
        frames unless given) convolved alone, its positions added."""
        batch, mel, frames = features.shape
        chunk = chunk or 2 * self.n_window
        x = features.view(batch, mel, frames // chunk, chunk).transpose(1, 2).reshape(-1, 1, mel, chunk)
        x = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(x))))))
        x = self.conv_out(x.permute(0, 3, 1, 2).flatten(2))  # [chunks, time, channels * mel'] -> d_model
        return x + self.positions[:x.shape[1]].to(x.dtype)

    def _windows(self, lengths: list[int]) -> list[int]:
        """Every audio's attention windows' lengths, in order."""
        return [min(self.window_rows, n - start) for n in lengths for start in range(0, n, self.window_rows)]

    def forward(self, features: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        chunk = 2 * self.n_window
        if features.shape[-1] % chunk:
            raise ValueError(f"{features.shape[-1]} mel frames: Qwen3-ASR's encoder takes whole chunks of {chunk}")
        packed = kept_rows(self._chunk_rows(features), frames, chunk)
        return self._attend(packed, [qwen3_asr_output_length(n, self.n_window) for n in frames])

    def _attend(self, packed: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        """Every audio's rows ``[sum(lengths), d_model]``, in order -> each audio's, through the layers (attending
        within windows) and ``ln_post``."""
        windows = self._windows(lengths)
        x = nn.utils.rnn.pad_sequence(list(packed.split(windows)), batch_first=True)
        keys_kept = torch.arange(x.shape[1], device=x.device)[None, :] < torch.tensor(windows, device=x.device)[:, None]
        for layer in self.layers:
            x = layer(x, keys_kept)
        return list(self.ln_post(x[keys_kept]).split(lengths))


class Qwen3ASRProjector(nn.Module):
    """``linear_2(gelu(linear_1(x)))``: the encoder's width, then the decoder's."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        audio = hf_config.audio_config
        if audio.output_dim != text_config_of(hf_config).hidden_size:
            raise ConfigError("audio_config.output_dim", audio.output_dim, "the decoder's hidden_size")
        self.linear_1 = nn.Linear(audio.d_model, audio.d_model, dtype=dtype)
        self.linear_2 = nn.Linear(audio.d_model, audio.output_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class Qwen3ASRForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """Audio rows replace the ``<|audio_pad|>`` placeholder embeddings; the rest is the Qwen3 decoder (Qwen2-Audio's
    hooks, weight names and LoRA routing)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        VisionLanguageModel.__init__(self)  # Qwen2-Audio's builds its own parts
        self.audio_tower = Qwen3ASREncoder(hf_config.audio_config, dtype)
        self.multi_modal_projector = Qwen3ASRProjector(hf_config, dtype)
        self.language_model = build_decoder(hf_config, {"qwen3": Qwen3ForCausalLM}, "Qwen3-ASR", mm_encoder_tp_mode,
                                            dtype=dtype, tp=tp, attn_backend=attn_backend, max_position=max_position,
                                            **decoder_options)

    mm_audio_extractor_kwargs = {"padding": True, "truncation": False, "return_attention_mask": True}
    """How transformers' ``Qwen3ASRProcessor`` calls the feature extractor: the whole audio, its frames padded to
    whole chunks."""

    @classmethod
    def mm_audio_windows(cls, waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        """The whole audio (the encoder windows it itself)."""
        return [waveform]

    @staticmethod
    def mm_placeholder_length_of(hf_config: Any, values: np.ndarray) -> int:
        n_window = hf_config.audio_config.n_window
        if values.shape[-1] % (2 * n_window):
            raise ConfigError("model", "preprocessor_config.json", f"a feature extractor whose n_window is "
                              f"audio_config.n_window = {n_window} (it padded an audio to {values.shape[-1]} frames)")
        return qwen3_asr_output_length(int(values[0, -1].sum()), n_window)

    def embed_multimodal(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``[N, 1, mel + 1, frames]`` packed audios -> each audio's ``[placeholders, text hidden]`` rows."""
        flat = values[:, 0]
        frames = flat[:, -1].sum(-1).round().long().tolist()
        rows = self.audio_tower(flat[:, :-1].to(self.audio_tower.conv_out.weight.dtype), frames)
        return [self.multi_modal_projector(r) for r in rows]
