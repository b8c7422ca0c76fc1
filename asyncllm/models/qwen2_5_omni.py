"""Qwen2.5-Omni's thinker (``Qwen2_5OmniThinkerForConditionalGeneration``, and ``Qwen2_5OmniForConditionalGeneration``:
Qwen/Qwen2.5-Omni-3B, -7B): text out only, as vLLM serves it.

The thinker is Qwen2.5-VL's vision tower (asyncllm/models/qwen_vision.py; its attention's q, k and v saved apart), an
audio encoder of its own and the Qwen2 decoder with M-RoPE (asyncllm/models/qwen2_vl.py). The full checkpoint's
talker and token2wav (speech out) are not built: their weights (``talker.*``, ``token2wav.*``) are skipped unread,
the thinker's (``thinker.*``) served, and its config is the ``thinker_config`` (asyncllm/models/family_config.py's
`omni_thinker_config`). Asking for
speech (``enable_audio_output`` in ``hf_overrides``) is a `NotBuiltError`.

The host reads each audio as Qwen2-Audio's (the first 30 s, the checkpoint's ``WhisperFeatureExtractor`` frames padded
to 3000 with their mask: asyncllm/models/qwen2_audio.py). The encoder cuts an audio's true frames into chunks of
``2 * n_window`` (the last shorter), convolves each chunk alone (Whisper's two GELU convolutions, the padded frames
zeroed between them), adds sinusoidal positions that restart at every chunk, attends within each chunk, then averages
the audio's rows in pairs, normalizes and projects them to the decoder's width: one row per ``<|AUDIO|>`` placeholder
(``((L - 1) // 2 + 1 - 2) // 2 + 1`` of ``L`` frames). Audio positions count on like text's (transformers'
``get_rope_index``), so only images and videos take M-RoPE's grid positions. A video is Qwen2.5-VL's (one run of
``<|VIDEO|>`` placeholders), its temporal patches ``position_id_per_seconds`` (25) x their seconds apart in time.
With ``mm_processor_kwargs={"use_audio_in_video": True}`` each video takes the next audio of the prompt (its track)
interleaved with its frames by 2 s chunks, as transformers' processor lays them (asyncllm/models/omni_interleave.py).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.omni_interleave import AudioInVideo
from asyncllm.models.omni_thinker import OmniThinker
from asyncllm.models.pipeline import in_missing_part
from asyncllm.models.qwen2_audio import (
    AudioEncoderLayer, Qwen2AudioForConditionalGeneration, add_audio_convolutions, audio_output_length,
)
from asyncllm.models.qwen2_vl import Qwen2VLForConditionalGeneration, normalize_qwen2_vl_name
from asyncllm.models.qwen3_asr import sinusoids
from asyncllm.models.vision_language import load_vision_language_weights

__all__ = ["Qwen2_5OmniAudioEncoder", "Qwen2_5OmniThinkerForConditionalGeneration"]

_SEPARATE_QKV = re.compile(r"^(visual\.blocks\.\d+\.attn)\.([qkv])\.(weight|bias)$")


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


class Qwen2_5OmniThinkerForConditionalGeneration(OmniThinker, Qwen2VLForConditionalGeneration):
    """Image and video features replace ``<|IMAGE|>`` and ``<|VIDEO|>`` placeholders, audio rows ``<|AUDIO|>`` ones;
    positions are M-RoPE's (the hooks: asyncllm/models/omni_thinker.py)."""

    speech_parts = ("talker.", "token2wav.")
    audio_tower_cls = Qwen2_5OmniAudioEncoder

    # ---- audio (asyncllm/models/omni_thinker.py's hooks)
    mm_audio_extractor_kwargs = Qwen2AudioForConditionalGeneration.mm_audio_extractor_kwargs
    mm_audio_in_video = staticmethod(AudioInVideo.of)

    @staticmethod
    def mm_audio_windows(waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        """The first 30 s (transformers' processor truncates there too)."""
        return [waveform[:30 * rate]]

    @classmethod
    def audio_placeholders(cls, hf_config: Any, frames: int) -> int:
        return audio_output_length(frames)

    def embed_audios(self, features: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        return self.audio_tower(features.to(self.audio_tower.conv1.weight.dtype), frames)

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The thinker's weights (either layout, ``thinker.`` or not); the vision attention's q, k and v into its
        fused projection; the talker's and token2wav's skipped unread."""
        params = dict(self.named_parameters())
        fused: dict[str, set[str]] = {}

        def rest() -> Iterable[tuple[str, LoadedWeight]]:
            for raw_name, weight in self.thinker_weights(weights):
                match = _SEPARATE_QKV.match(normalize_omni_name(raw_name))
                if match is None:
                    yield raw_name, weight
                    continue
                attn, shard, kind = match.groups()
                name = f"{attn}.qkv.{kind}"
                if in_missing_part(self, name):  # a pipeline stage after the first: the tower is the first's
                    continue
                self.get_submodule(f"{attn}.qkv").weight_loader(params[name], weight, shard)
                fused.setdefault(name, set()).add(shard)

        loaded = load_vision_language_weights(self, rest(), normalize_omni_name, "Qwen2.5-Omni")
        return loaded | {name for name, shards in fused.items() if shards == {"q", "k", "v"}}
