"""Granite Speech's audio features without torchaudio: `GraniteSpeechFeatures` in place of transformers'
``GraniteSpeechFeatureExtractor``, which needs torchaudio's ``MelSpectrogram`` (not a dependency of asyncllm).

The same computation in torch: a power spectrogram (``torch.stft``: periodic Hann window of ``win_length`` centered
in ``n_fft``, ``hop_length``, the audio reflect-padded by ``n_fft / 2`` at both ends), torchaudio's HTK mel filter
bank (no normalization, 0 Hz to half the rate, built as torchaudio builds it, in float32), then transformers' log
scaling: ``log10`` of the mel powers floored at 1e-10, floored again at the audio's maximum minus 8, divided by 4,
plus 1. An odd last frame is dropped and each two consecutive frames are joined: ``[frames / 2, 2 * n_mels]``, one
row per encoder position. Each audio is computed alone (transformers' extractor pads a batch of audios with zeros
first, which changes a shorter audio's frames near its end).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch

from asyncllm.errors import ConfigError, InvalidRequestError

__all__ = ["GraniteSpeechFeatures", "granite_speech_rows", "htk_mel_filters"]

_SETTINGS = {"sampling_rate": 16000, "n_fft": 512, "win_length": 400, "hop_length": 160, "n_mels": 80}
"""transformers' defaults for the settings a ``preprocessor_config.json`` may leave out."""


def granite_speech_rows(frames: int, window_size: int, downsample_rate: int) -> int:
    """Projector rows (= ``<|audio|>`` placeholders) of ``frames`` encoder positions: the projector pads them to
    whole windows of ``window_size`` and makes ``window_size // downsample_rate`` rows of each."""
    return math.ceil(frames / window_size) * (window_size // downsample_rate)


def htk_mel_filters(n_freqs: int, n_mels: int, sampling_rate: int) -> torch.Tensor:
    """``[n_freqs, n_mels]`` float32 triangular filters on the HTK mel scale from 0 Hz to half the rate, unnormalized
    (torchaudio's ``melscale_fbanks`` as ``MelSpectrogram`` calls it)."""
    freqs = torch.linspace(0, sampling_rate // 2, n_freqs)
    top = 2595.0 * math.log10(1.0 + (sampling_rate // 2) / 700.0)
    edges = 700.0 * (10 ** (torch.linspace(0.0, top, n_mels + 2) / 2595.0) - 1.0)
    widths = edges[1:] - edges[:-1]
    distance = edges[None, :] - freqs[:, None]
    rising = -distance[:, :-2] / widths[:-1]
    falling = distance[:, 2:] / widths[1:]
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


class GraniteSpeechFeatures:
    """The checkpoint's audio settings (its ``preprocessor_config.json``) and the log-mel features of an audio, called
    as the host calls an HF feature extractor (asyncllm/mm/processor.py)."""

    def __init__(self, sampling_rate: int, n_fft: int, win_length: int, hop_length: int, n_mels: int) -> None:
        self.sampling_rate, self.n_fft, self.hop_length, self.n_mels = sampling_rate, n_fft, hop_length, n_mels
        self.win_length = win_length
        self.window = torch.hann_window(win_length)
        self.filters = htk_mel_filters(n_fft // 2 + 1, n_mels, sampling_rate)

    @classmethod
    def from_pretrained(cls, path: str) -> GraniteSpeechFeatures:
        """The settings of ``path``'s ``preprocessor_config.json`` (transformers' defaults for those it leaves out);
        `ConfigError` without one, or for an older nested ``melspec_kwargs`` that disagrees with them (transformers
        reads the flat ones)."""
        file = os.path.join(path, "preprocessor_config.json")
        try:
            with open(file, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError("model", path, f"a checkpoint with its preprocessor_config.json ({exc})") from exc
        settings = {key: int(saved.get(key, default)) for key, default in _SETTINGS.items()}
        nested = dict(saved.get("melspec_kwargs") or {})
        nested.setdefault("sampling_rate", nested.pop("sample_rate", settings["sampling_rate"]))
        if any(settings.get(key, value) != value for key, value in nested.items()):
            raise ConfigError("preprocessor_config.json melspec_kwargs", nested,
                              f"the settings transformers' GraniteSpeechFeatureExtractor uses: {settings}")
        return cls(**settings)

    def log_mel(self, waveform: np.ndarray) -> torch.Tensor:
        """One audio's ``[frames / 2, 2 * n_mels]`` float32 features."""
        if waveform.size <= self.n_fft // 2:
            raise InvalidRequestError("audio", f"too short: {waveform.size} samples; Granite Speech's features need "
                                               f"more than {self.n_fft // 2} ({self.n_fft / 2 / self.sampling_rate:.3f} s)")
        audio = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))
        spectrum = torch.stft(audio, self.n_fft, self.hop_length, self.win_length, self.window, center=True,
                              pad_mode="reflect", return_complex=True).abs().pow(2.0)
        logmel = torch.matmul(spectrum.transpose(0, 1), self.filters).clamp(min=1e-10).log10()
        logmel = torch.maximum(logmel, logmel.max() - 8.0) / 4 + 1
        frames = logmel.shape[0] // 2 * 2
        return logmel[:frames].reshape(frames // 2, 2 * self.n_mels)

    def __call__(self, audios: list[np.ndarray], sampling_rate: int, return_tensors: str = "np",
                 **unused: Any) -> dict[str, np.ndarray]:
        """``{"input_features": [len(audios), frames / 2, 2 * n_mels]}`` of audios of one length at the checkpoint's
        rate (the host passes one)."""
        if sampling_rate != self.sampling_rate:
            raise ValueError(f"audio at {sampling_rate} Hz; Granite Speech's features are computed at "
                             f"{self.sampling_rate} Hz")
        with torch.no_grad():
            features = torch.stack([self.log_mel(audio) for audio in audios])
        return {"input_features": features.numpy()}
