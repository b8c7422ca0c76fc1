"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``: Qwen2-Audio-7B, -Instruct) and Audio Flamingo 3
(``AudioFlamingo3ForConditionalGeneration``: nvidia/audio-flamingo-3-hf): a Whisper-style audio encoder, a projector
(Qwen2-Audio: one linear; Audio Flamingo 3: two with a GELU), and the Qwen2 decoder of qwen2.py.

The host turns each audio into the checkpoint's ``WhisperFeatureExtractor`` log-mel features, padded to 30 s (3000
frames) per window (Qwen2-Audio: one window, the audio cut at 30 s; Audio Flamingo 3: consecutive 30 s windows, up
to 10 minutes), and packs each window's frames with their mask as one ``[windows, mel + 1, 3000]`` float32 array
(`mm_audio_values`): the encoder needs the true length (its attention masks the padded frames' keys) and the padded
frames themselves (the convolutions read one frame past the end). The encoder: two GELU convolutions (the second halves the frames
to 1500), learned positions, pre-norm transformer layers (queries scaled before the product, keys without bias),
average pooling by 2 and a LayerNorm; its first ``((L - 1) // 2 + 1 - 2) // 2 + 1`` rows (``L`` the audio's
frames) replace the prompt's ``<|AUDIO|>`` placeholders, one each, after the projector. The encoder is whole on
every tensor-parallel rank (a few hundred MB in the release); the decoder splits as Qwen2's.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import NotBuiltError
from asyncllm.mm.audios import audio_output_length
from asyncllm.models.decoder_lora import DecoderLoRA
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.qwen2 import Qwen2ForCausalLM
from asyncllm.models.vision_language import (
    VisionLanguageModel, build_decoder, load_vision_language_weights, text_config_of,
)

__all__ = ["AudioFlamingo3ForConditionalGeneration", "Qwen2AudioForConditionalGeneration", "add_audio_convolutions",
           "audio_output_length", "convolved_frames", "normalize_qwen2_audio_name"]


def _encoder_sizes(cfg: Any) -> tuple[int, int, int, int]:
    """(width, heads, MLP width, layers) under Whisper's names (Qwen2-Audio's) or the common ones (Audio
    Flamingo 3's)."""
    if hasattr(cfg, "d_model"):
        return cfg.d_model, cfg.encoder_attention_heads, cfg.encoder_ffn_dim, cfg.encoder_layers
    return cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers


def add_audio_convolutions(module: nn.Module, mel_bins: int, dim: int, dtype: torch.dtype) -> None:
    """Whisper's front end on ``module``: ``conv1`` (width 3) and ``conv2`` (width 3, stride 2: half the frames)."""
    module.conv1 = nn.Conv1d(mel_bins, dim, kernel_size=3, padding=1, dtype=dtype)
    module.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1, dtype=dtype)


def convolved_frames(module: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """``[B, mel, frames]`` -> ``[B, frames / 2, dim]`` through `add_audio_convolutions`' layers, each with a GELU."""
    return F.gelu(module.conv2(F.gelu(module.conv1(features)))).transpose(1, 2)


class AudioAttention(nn.Module):
    """Whisper's bidirectional attention: the queries scaled by ``head_dim ** -0.5`` before the product; no key
    bias."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim, dtype=dtype)
        self.k_proj = nn.Linear(dim, dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(dim, dim, dtype=dtype)
        self.out_proj = nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor, keys_kept: torch.Tensor | None) -> torch.Tensor:
        """``x`` ``[B, T, D]``; ``keys_kept`` ``[B, T]`` (False: a padded frame no query attends to; None: all)."""
        batch, length, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x) * self.scale), heads(self.k_proj(x)), heads(self.v_proj(x))
        mask = None if keys_kept is None else keys_kept[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, dim))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        dim, heads, ffn, _ = _encoder_sizes(cfg)
        if cfg.activation_function != "gelu":
            raise NotBuiltError("audio_config.activation_function", cfg.activation_function, "'gelu'")
        self.self_attn = AudioAttention(dim, heads, dtype)
        self.self_attn_layer_norm = nn.LayerNorm(dim, dtype=dtype)
        self.fc1 = nn.Linear(dim, ffn, dtype=dtype)
        self.fc2 = nn.Linear(ffn, dim, dtype=dtype)
        self.final_layer_norm = nn.LayerNorm(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, keys_kept: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), keys_kept)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Qwen2AudioEncoder(nn.Module):
    """Log-mel frames ``[B, mel, 2 * positions * 2]`` -> ``[B, positions / 2, d_model]`` (transformers'
    ``Qwen2AudioEncoder`` with its padded frames' keys masked); Whisper's without the pooling (`pooled`) and the
    mask (its padded frames attended, as transformers' ``WhisperEncoder``)."""

    pooled = True

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        dim, _, _, layers = _encoder_sizes(cfg)
        if cfg.scale_embedding:
            raise NotBuiltError("audio_config.scale_embedding", True, "Qwen2-Audio's encoder without embedding scale")
        add_audio_convolutions(self, cfg.num_mel_bins, dim, dtype)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, dim, dtype=dtype)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg, dtype) for _ in range(layers))
        self.layer_norm = nn.LayerNorm(dim, dtype=dtype)

    def forward(self, features: torch.Tensor, frames: torch.Tensor | None = None) -> torch.Tensor:
        """``features`` ``[B, mel, 3000]``, ``frames`` ``[B]`` each audio's unpadded frames (None: every frame
        attended)."""
        x = convolved_frames(self, features)
        x = (x + self.embed_positions.weight).to(x.dtype)  # summed in the table's dtype (Voxtral's is float32)
        kept = None if frames is None else (
            torch.arange(x.shape[1], device=x.device)[None, :] < ((frames - 1) // 2 + 1)[:, None])
        for layer in self.layers:
            x = layer(x, kept)
        if self.pooled:
            x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(x)


class Qwen2AudioProjector(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(hf_config.audio_config.d_model, text_config_of(hf_config).hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class AudioFlamingo3Projector(nn.Module):
    """``linear_2(gelu(linear_1(x)))``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if hf_config.projector_hidden_act != "gelu":
            raise NotBuiltError("projector_hidden_act", hf_config.projector_hidden_act, "'gelu'")
        text, bias = text_config_of(hf_config).hidden_size, bool(hf_config.projector_bias)
        self.linear_1 = nn.Linear(hf_config.audio_config.hidden_size, text, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(text, text, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


_DECODER_NAMES = ("model.layers.", "model.embed_tokens.", "model.norm.")
"""An adapter's decoder names (asyncllm/lora_names.py); a checkpoint's are ``model.language_model.`` (transformers
4.52+) or ``language_model.model.``."""


def normalize_qwen2_audio_name(name: str) -> str:
    """A checkpoint's name (either layout), or an adapter's decoder name (``model.layers...``) -> ours."""
    return "language_model." + name if name.startswith(_DECODER_NAMES) else normalize_llava_name(name)


class Qwen2AudioForConditionalGeneration(DecoderLoRA, VisionLanguageModel):
    """Audio features replace the ``<|AUDIO|>`` placeholder embeddings; the rest is the Qwen2 decoder."""

    mm_string_placeholder = False
    """A "string" chat's media parts are refused: vLLM's placeholder text differs from the marker token
    (`MultiModalProcessor.placeholder_text`)."""

    mm_takes_images = False
    """Audio only: no image processor, no image placeholder (asyncllm/mm/processor.py)."""
    normalize_name = staticmethod(normalize_qwen2_audio_name)
    """`_packed` reads a checkpoint's names as well as an adapter's decoder names."""
    projector_cls: type[nn.Module] = Qwen2AudioProjector
    decoders: dict[str, type] = {"qwen2": Qwen2ForCausalLM}
    """The decoder class of each ``text_config.model_type`` built."""
    max_windows = 1
    """30 s windows an audio is cut into (Qwen2-Audio: the first 30 s only)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        super().__init__()
        self.audio_tower = self.build_encoder(hf_config.audio_config, dtype)
        self.multi_modal_projector = self.projector_cls(hf_config, dtype)
        self.language_model = build_decoder(hf_config, self.decoders, type(self).__name__, mm_encoder_tp_mode,
                                            dtype=dtype, tp=tp, attn_backend=attn_backend, max_position=max_position,
                                            **decoder_options)

    @staticmethod
    def build_encoder(cfg: Any, dtype: torch.dtype) -> nn.Module:
        return Qwen2AudioEncoder(cfg, dtype)

    @staticmethod
    def audio_rows(frames: int) -> int:
        """Encoder rows (= placeholders) of a window of ``frames`` mel frames."""
        return audio_output_length(frames)

    def encode_windows(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """``[W, mel, 3000]`` windows and their unpadded ``frames`` -> ``[W, rows, text hidden]`` projected rows."""
        return self.multi_modal_projector(self.audio_tower(features, frames))

    # ---- multimodal hooks (asyncllm/mm/)
    @staticmethod
    def mm_audio_token_id(hf_config: Any) -> int:
        """The prompt token that marks an audio (``<|AUDIO|>``; Audio Flamingo 3's ``<sound>``)."""
        token = getattr(hf_config, "audio_token_index", None)
        return int(token if token is not None else hf_config.audio_token_id)

    mm_audio_extractor_kwargs = {"padding": "max_length", "return_attention_mask": True}
    """How the host calls the feature extractor (as transformers' processors do): 30 s of frames per window and
    their mask."""

    @classmethod
    def mm_audio_windows(cls, waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        """The 30 s windows the feature extractor reads (`max_windows` at most; the last one shorter)."""
        size = 30 * rate
        count = min(cls.max_windows, max(1, -(-waveform.size // size)))
        return [waveform[i * size:(i + 1) * size] for i in range(count)]

    @staticmethod
    def mm_audio_values(processed: Any) -> np.ndarray:
        """The feature extractor's output for one audio's windows -> ``[windows, mel + 1, frames]`` float32: each
        window's log-mel features and, as its last row, their frame mask."""
        features = processed["input_features"].astype("float32", copy=False)
        mask = processed["attention_mask"].astype("float32", copy=False)
        return np.concatenate([features, mask[:, None]], axis=1)

    @classmethod
    def mm_placeholder_length_of(cls, hf_config: Any, values: np.ndarray) -> int:
        return sum(cls.audio_rows(int(frames)) for frames in values[:, -1].sum(-1))

    def embed_multimodal(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``[N, windows, mel + 1, frames]`` packed audios -> each audio's ``[placeholders, text hidden]`` rows (its
        windows' rows in order)."""
        audios, windows = values.shape[:2]
        flat = values.flatten(0, 1)
        frames = flat[:, -1].sum(-1).round().long()
        rows = self.encode_windows(flat[:, :-1].to(self.audio_tower.conv1.weight.dtype), frames)
        kept = [rows[i, :self.audio_rows(int(n))] for i, n in enumerate(frames.tolist())]
        return [torch.cat(kept[a * windows:(a + 1) * windows]) for a in range(audios)]

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return load_vision_language_weights(self, weights, normalize_llava_name, type(self).__name__)


class AudioFlamingo3ForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """Qwen2-Audio's encoder under Audio Flamingo 3's config names, a two-layer projector, ``<sound>`` placeholders,
    audio up to 10 minutes in 30 s windows (transformers' ``AudioFlamingo3Processor``)."""

    projector_cls = AudioFlamingo3Projector
    max_windows = 20
