"""Qwen2.5-Omni's thinker (``Qwen2_5OmniThinkerForConditionalGeneration``, and ``Qwen2_5OmniForConditionalGeneration``:
Qwen/Qwen2.5-Omni-3B, -7B): text out only, as vLLM serves it.

The thinker is Qwen2.5-VL's vision tower (asyncllm/models/qwen_vision.py; its attention's q, k and v saved apart), an
audio encoder of its own and the Qwen2 decoder with M-RoPE (asyncllm/models/qwen2_vl.py). The full checkpoint's
talker and token2wav (speech out) are not built: their weights (``talker.*``, ``token2wav.*``) are skipped unread,
the thinker's (``thinker.*``) served, and its config is the ``thinker_config`` (asyncllm/models/family_config.py's
`omni_thinker_config`). Asking for
speech (``enable_audio_output`` in ``hf_overrides``) or for a video's own audio (``use_audio_in_video``) is a
`NotBuiltError`.

The host reads each audio as Qwen2-Audio's (the first 30 s, the checkpoint's ``WhisperFeatureExtractor`` frames padded
to 3000 with their mask: asyncllm/models/qwen2_audio.py). The encoder cuts an audio's true frames into chunks of
``2 * n_window`` (the last shorter), convolves each chunk alone (Whisper's two GELU convolutions, the padded frames
zeroed between them), adds sinusoidal positions that restart at every chunk, attends within each chunk, then averages
the audio's rows in pairs, normalizes and projects them to the decoder's width: one row per ``<|AUDIO|>`` placeholder
(``((L - 1) // 2 + 1 - 2) // 2 + 1`` of ``L`` frames). Audio positions count on like text's (transformers'
``get_rope_index``), so only images and videos take M-RoPE's grid positions. A video is Qwen2.5-VL's (one run of
``<|VIDEO|>`` placeholders), its temporal patches ``position_id_per_seconds`` (25) x their seconds apart in time; a
video's own audio track is not read (``use_audio_in_video``).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.qwen_video import VideoPiece
from asyncllm.mm.videos import Video
from asyncllm.models.layers import LoadedWeight, TensorParallel
from asyncllm.models.qwen2_audio import (
    AudioEncoderLayer, Qwen2AudioForConditionalGeneration, add_audio_convolutions, audio_output_length,
)
from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration, normalize_qwen2_vl_name
from asyncllm.models.qwen3_asr import sinusoids
from asyncllm.models.vision_language import load_vision_language_weights, text_config_of

__all__ = ["Qwen2_5OmniAudioEncoder", "Qwen2_5OmniThinkerForConditionalGeneration", "check_omni_processor_kwargs"]

_SPEECH_PARTS = ("talker.", "token2wav.")
"""The full checkpoint's speech-out parts, not served."""
_REFUSED_PROCESSOR_KWARGS = ("use_audio_in_video", "load_audio_from_video", "return_audio", "enable_audio_output",
                             "speaker")
_SEPARATE_QKV = re.compile(r"^(visual\.blocks\.\d+\.attn)\.([qkv])\.(weight|bias)$")


def check_omni_processor_kwargs(overrides: dict[str, Any]) -> None:
    """`NotBuiltError` for ``mm_processor_kwargs`` asking for speech out or a video's interleaved audio."""
    for key in _REFUSED_PROCESSOR_KWARGS:
        if overrides.get(key):
            raise NotBuiltError(f"mm_processor_kwargs.{key}", overrides[key],
                                "Qwen2.5-Omni's speech output and audio-in-video (the thinker serves text from "
                                "images, videos and audios given apart)")


class Qwen2_5OmniAudioEncoder(nn.Module):
    """Log-mel frames ``[B, mel, frames]`` and each audio's true frames -> each audio's ``[rows, output_dim]``
    (transformers' ``Qwen2_5OmniAudioEncoder``)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        dim = cfg.d_model
        if cfg.scale_embedding:
            raise NotBuiltError("audio_config.scale_embedding", True, "Qwen2.5-Omni's encoder with embedding scale")
        if cfg.max_source_positions < cfg.n_window:
            raise ConfigError("audio_config.max_source_positions", cfg.max_source_positions,
                              f"at least a chunk's n_window = {cfg.n_window} rows")
        self.chunk = 2 * cfg.n_window
        add_audio_convolutions(self, cfg.num_mel_bins, dim, dtype)
        positions = sinusoids(cfg.n_window, dim)
        self.register_buffer("positions", positions.to(torch.get_default_device()), persistent=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg, dtype) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(dim, dtype=dtype)
        self.proj = nn.Linear(dim, cfg.output_dim, dtype=dtype)
        self.audio_bos_eos_token = nn.Embedding(2, cfg.output_dim, dtype=dtype)
        """In the checkpoint, unused by the thinker (transformers' too)."""

    def _chunks(self, features: torch.Tensor, frames: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every audio's true frames cut into chunks -> (``[C, mel, chunk]`` zero-padded, each chunk's frames)."""
        pieces = [f[:, start:min(start + self.chunk, n)].T for f, n in zip(features, frames)
                  for start in range(0, n, self.chunk)]
        lengths = torch.tensor([p.shape[0] for p in pieces], device=features.device)
        return nn.utils.rnn.pad_sequence(pieces, batch_first=True).transpose(1, 2), lengths

    def forward(self, features: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        chunks, lengths = self._chunks(features, frames)
        kept_frames = (torch.arange(chunks.shape[-1], device=chunks.device) < lengths[:, None])[:, None]
        x = F.gelu(self.conv1(chunks)) * kept_frames
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.positions[:x.shape[1]].to(x.dtype)
        kept = torch.arange(x.shape[1], device=x.device)[None, :] < ((lengths - 1) // 2 + 1)[:, None]
        for layer in self.layers:
            x = layer(x, kept)
        out = []
        for rows in x[kept].split([(n - 1) // 2 + 1 for n in frames]):  # each audio's rows, its chunks in order
            pairs = rows.shape[0] // 2  # average pooling by 2 (an odd last row dropped)
            out.append(self.proj(self.ln_post((rows[0:2 * pairs:2] + rows[1:2 * pairs:2]) / 2)))
        return out


def normalize_omni_name(name: str) -> str:
    """Any Qwen2.5-Omni checkpoint layout -> ours (``audio_tower.*``, ``visual.*``, ``language_model.*``)."""
    name = name.removeprefix("thinker.")
    if name.startswith("model.audio_tower."):
        return name.removeprefix("model.")
    return normalize_qwen2_vl_name(name)


class Qwen2_5OmniThinkerForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Image and video features replace ``<|IMAGE|>`` and ``<|VIDEO|>`` placeholders, audio rows ``<|AUDIO|>`` ones;
    positions are M-RoPE's."""

    @staticmethod
    def mm_video_token_id(hf_config: Any) -> int:
        """The prompt token that marks a video (``<|VIDEO|>``)."""
        return int(hf_config.video_token_id)

    @classmethod
    def mm_video_pieces(cls, hf_config: Any, tokenizer: Any, video: Video, grid: tuple[int, int, int]) -> list[VideoPiece]:
        """A video is one run of placeholders, its temporal patches ``position_id_per_seconds`` x their seconds
        apart on the time axis (float32)."""
        seconds = np.float32(hf_config.vision_config.temporal_patch_size / video.sampled_fps)
        return [VideoPiece([], slice(0, grid[0]), [], float(seconds * np.float32(hf_config.position_id_per_seconds)))]

    def __init__(self, hf_config: Any, *, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                 max_position: int, mm_encoder_tp_mode: str = "weights", **decoder_options: Any) -> None:
        if getattr(hf_config, "enable_audio_output", False):
            raise NotBuiltError("enable_audio_output", True, "Qwen2.5-Omni's speech output (its talker and "
                                                             "token2wav); the thinker serves text")
        super().__init__(hf_config, dtype=dtype, tp=tp, attn_backend=attn_backend, max_position=max_position,
                         mm_encoder_tp_mode=mm_encoder_tp_mode, **decoder_options)
        if hf_config.audio_config.output_dim != text_config_of(hf_config).hidden_size:
            raise ConfigError("audio_config.output_dim", hf_config.audio_config.output_dim, "the decoder's hidden_size")
        self.audio_tower = Qwen2_5OmniAudioEncoder(hf_config.audio_config, dtype)

    # ---- multimodal hooks (asyncllm/mm/processor.py)
    @staticmethod
    def mm_placeholder_token_id(hf_config: Any) -> int:
        """The prompt token that marks an image (``<|IMAGE|>``)."""
        return int(hf_config.image_token_id)

    @staticmethod
    def mm_audio_token_id(hf_config: Any) -> int:
        """The prompt token that marks an audio (``<|AUDIO|>``)."""
        return int(hf_config.audio_token_id)

    mm_audio_extractor_kwargs = Qwen2AudioForConditionalGeneration.mm_audio_extractor_kwargs
    mm_audio_values = staticmethod(Qwen2AudioForConditionalGeneration.mm_audio_values)
    mm_check_processor_kwargs = staticmethod(check_omni_processor_kwargs)

    @staticmethod
    def mm_audio_windows(waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        """The first 30 s (transformers' processor truncates there too)."""
        return [waveform[:30 * rate]]

    @classmethod
    def mm_placeholder_length_of(cls, hf_config: Any, values: np.ndarray) -> int:
        """An image's ``(t, h, w, features)`` patches or an audio's ``[1, mel + 1, frames]`` -> its placeholders."""
        if values.ndim == 3:
            return audio_output_length(int(values[0, -1].sum()))
        return cls.mm_placeholder_length(hf_config, values.shape)

    def mrope_positions(self, prompt_len: int, items: list[Any]) -> tuple[np.ndarray, int]:
        """M-RoPE's positions of the images and videos; an audio's placeholders count on as text does."""
        return super().mrope_positions(prompt_len, [item for item in items if len(item.shape) == 4])

    def embed_multimodal(self, values: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """``[N, t, h, w, features]`` images or videos -> their rows (Qwen2.5-VL's); ``[N, 1, mel + 1, frames]`` audios -> each
        audio's ``[placeholders, text hidden]`` rows."""
        if values.ndim == 5:
            return super().embed_multimodal(values)
        flat = values[:, 0]
        frames = flat[:, -1].sum(-1).round().long().tolist()
        return self.audio_tower(flat[:, :-1].to(self.audio_tower.conv1.weight.dtype), frames)

    # ---- weights
    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        return super()._packed(ckpt_name.removeprefix("thinker."))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The thinker's weights (either layout, ``thinker.`` or not); the vision attention's q, k and v into its
        fused projection; the talker's and token2wav's skipped unread."""
        params = dict(self.named_parameters())
        fused: dict[str, set[str]] = {}

        def rest() -> Iterable[tuple[str, LoadedWeight]]:
            for raw_name, weight in weights:
                if raw_name.startswith(_SPEECH_PARTS):
                    continue
                match = _SEPARATE_QKV.match(normalize_omni_name(raw_name))
                if match is None:
                    yield raw_name, weight
                    continue
                attn, shard, kind = match.groups()
                name = f"{attn}.qkv.{kind}"
                self.get_submodule(f"{attn}.qkv").weight_loader(params[name], weight, shard)
                fused.setdefault(name, set()).add(shard)

        loaded = load_vision_language_weights(self, rest(), normalize_omni_name, "Qwen2.5-Omni")
        return loaded | {name for name, shards in fused.items() if shards == {"q", "k", "v"}}
