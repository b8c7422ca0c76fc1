"""Voxtral (``VoxtralForConditionalGeneration``: mistralai/Voxtral-Mini-3B-2507, Voxtral-Small-24B-2507): Whisper's
encoder, a projector over groups of stacked encoder rows, and a Llama / Mistral decoder (llama.py).

The host computes each audio's features as transformers' ``VoxtralProcessor`` does: the checkpoint's
``WhisperFeatureExtractor`` over the whole audio padded with silence to a multiple of 30 s (``pad_to_multiple_of``
480000 samples; one log-mel normalisation over it all), its frames then cut into 30 s windows of 3000
(`mm_audio_values`: ``[windows, mel, 3000]`` float32). The encoder is Whisper's (qwen2_audio.py's layers, no pooling,
every frame of every window attended: transformers masks nothing), its learned positions kept in float32 as
transformers keeps them; each window's 1500 rows are stacked ``intermediate_size / hidden_size`` (4) at a time into
the two-layer projector (no biases), so a window fills ``1500 / 4`` = 375 placeholders whatever its sound, as
mistral_common's 12.5 tokens a second over the padded audio. A prompt marks an audio with one ``[AUDIO]``
(``audio_token_id``) after the ``[BEGIN_AUDIO]`` mistral_common writes before it; the host repeats the ``[AUDIO]``.
The encoder is whole on every tensor-parallel rank; the decoder splits as Llama's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.qwen2_audio import Qwen2AudioEncoder, Qwen2AudioForConditionalGeneration
from asyncllm.models.vision_language import text_config_of

__all__ = ["VoxtralEncoder", "VoxtralForConditionalGeneration", "voxtral_stack"]

WINDOW_SAMPLES = 480_000
"""30 s at 16 kHz: the processor pads every audio to a multiple of it (``pad_to_multiple_of``)."""


def voxtral_stack(cfg: Any) -> int:
    """Encoder rows stacked into one projector input (``intermediate_size / hidden_size``; `NotBuiltError` unless
    it divides a window's rows, which transformers' reshape would otherwise mix across windows)."""
    dim, width = cfg.hidden_size, cfg.intermediate_size
    if width % dim or cfg.max_source_positions % (width // dim):
        raise NotBuiltError("audio_config.intermediate_size", width, f"Voxtral's projector over other than k x "
                            f"hidden_size ({dim}) with k dividing max_source_positions ({cfg.max_source_positions})")
    return width // dim


class VoxtralEncoder(Qwen2AudioEncoder):
    """transformers' ``VoxtralEncoder``: Whisper's (no pooling, no mask), its positions kept and added in float32
    (`Qwen2AudioEncoder.forward` sums in the table's dtype), the rows cast back to the model's."""

    pooled = False

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.hidden_size, dtype=torch.float32)


class VoxtralProjector(nn.Module):
    """``linear_2(act(linear_1(x)))`` over stacked encoder rows, no biases."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if hf_config.projector_hidden_act != "gelu":
            raise NotBuiltError("projector_hidden_act", hf_config.projector_hidden_act, "'gelu'")
        text = text_config_of(hf_config).hidden_size
        self.linear_1 = nn.Linear(hf_config.audio_config.intermediate_size, text, bias=False, dtype=dtype)
        self.linear_2 = nn.Linear(text, text, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class VoxtralForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """Qwen2-Audio's loading, LoRA and placeholder handling (qwen2_audio.py) over Voxtral's features, encoder,
    projector and Llama decoder."""

    projector_cls = VoxtralProjector
    decoders = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM}

    @staticmethod
    def build_encoder(cfg: Any, dtype: torch.dtype) -> nn.Module:
        if cfg.max_source_positions != 1500:  # the processor cuts 3000-frame windows, the encoder halves them
            raise NotBuiltError("audio_config.max_source_positions", cfg.max_source_positions,
                                "Voxtral with other than 1500 encoder rows per 3000-frame window")
        voxtral_stack(cfg)
        return VoxtralEncoder(cfg, dtype)

    @staticmethod
    def mm_audio_token_id(hf_config: Any) -> int:
        """``[AUDIO]`` (the config's ``audio_token_id``; 24 in the releases)."""
        return int(hf_config.audio_token_id)

    mm_audio_extractor_kwargs = {"padding": True, "truncation": False, "pad_to_multiple_of": WINDOW_SAMPLES}
    """``VoxtralProcessor``'s audio kwargs: the whole audio, padded to whole 30 s windows."""

    @staticmethod
    def mm_audio_windows(waveform: np.ndarray, rate: int) -> list[np.ndarray]:
        """The whole audio, one extractor call (its windows are cut from the frames: `mm_audio_values`)."""
        return [waveform]

    @staticmethod
    def mm_audio_values(processed: Any) -> np.ndarray:
        """``[1, mel, 3000 * W]`` frames -> ``[W, mel, 3000]`` float32 windows (``VoxtralProcessor``'s reshape)."""
        features = processed["input_features"][0].astype("float32", copy=False)
        mel = features.shape[0]
        return np.ascontiguousarray(features.reshape(mel, -1, 3000).transpose(1, 0, 2))

    @classmethod
    def mm_placeholder_length_of(cls, hf_config: Any, values: np.ndarray) -> int:
        cfg = hf_config.audio_config
        return values.shape[0] * (cfg.max_source_positions // voxtral_stack(cfg))

    def embed_multimodal(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``[N, W, mel, 3000]`` audios -> each audio's ``[W * 375, text hidden]`` rows (its windows' in order; a
        window's 1500 rows hold whole stacks, so stacking across the audio's rows is stacking per window)."""
        audios = values.shape[0]
        rows = self.audio_tower(values.flatten(0, 1).to(self.audio_tower.conv1.weight.dtype))
        stacked = rows.reshape(audios, -1, self.multi_modal_projector.linear_1.in_features)  # consecutive rows
        return list(self.multi_modal_projector(stacked).unbind(0))
