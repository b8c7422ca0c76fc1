"""Granite Speech's audio features without torchaudio (asyncllm/mm/granite_speech_audio.py): equal, within float32
noise, to transformers' ``GraniteSpeechFeatureExtractor`` steps over an independent mel spectrogram (transformers'
numpy ``audio_utils``, float64, in place of torchaudio's); placeholders as its ``_get_num_audio_features`` counts."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from audio_utils import make_audio

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.mm.granite_speech_audio import GraniteSpeechFeatures, granite_speech_rows

SETTINGS = {"sampling_rate": 16000, "n_fft": 512, "win_length": 400, "hop_length": 160, "n_mels": 80}


class _NumpyMel:
    """torchaudio's ``MelSpectrogram`` as transformers' extractor calls it, from transformers' numpy functions."""

    def to(self, device: str) -> _NumpyMel:
        return self

    def __call__(self, audio: torch.Tensor) -> torch.Tensor:
        from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

        filters = mel_filter_bank(257, 80, 0.0, 8000.0, 16000, norm=None, mel_scale="htk")
        window = window_function(400, "hann", frame_length=512)
        mels = [spectrogram(row.double().numpy(), window, 512, 160, 512, power=2.0, mel_filters=filters,
                            mel_floor=0.0, dtype=np.float64) for row in audio]
        return torch.from_numpy(np.stack(mels))


def _transformers_features(waveform: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """Its extractor's steps after the mel spectrogram (its torchaudio check skipped: `_NumpyMel` stands in)."""
    from transformers.models.granite_speech import feature_extraction_granite_speech as module

    monkeypatch.setattr(module, "requires_backends", lambda *args: None)
    stand_in = types.SimpleNamespace(mel_filters=_NumpyMel())
    audio = torch.from_numpy(waveform)[None]
    return module.GraniteSpeechFeatureExtractor._extract_mel_spectrograms(stand_in, audio)[0].float().numpy()


@pytest.mark.parametrize("seconds", [1.0, 1.37])  # an odd and an even number of mel frames
def test_features_equal_transformers_steps_over_a_reference_mel_spectrogram(seconds: float, monkeypatch) -> None:
    waveform = make_audio(seconds, seed=4)
    ours = GraniteSpeechFeatures(**SETTINGS)([waveform], 16000)["input_features"][0]
    expected = _transformers_features(waveform, monkeypatch)
    assert ours.shape == expected.shape == ((len(waveform) // 160 + 1) // 2, 160)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-5)


def test_placeholders_as_transformers_counts_them() -> None:
    from transformers.models.granite_speech.feature_extraction_granite_speech import GraniteSpeechFeatureExtractor

    stand_in = types.SimpleNamespace(melspec_kwargs={"hop_length": 160}, projector_window_size=15,
                                     projector_downsample_rate=5)
    lengths = [257, 4639, 4640, 4800, 4960, 9600, 16000, 16159]  # around the 15-row (300 ms) windows' edges
    expected = GraniteSpeechFeatureExtractor._get_num_audio_features(stand_in, lengths)
    features = GraniteSpeechFeatures(**SETTINGS)
    assert [granite_speech_rows(features.log_mel(np.zeros(n, np.float32)).shape[0], 15, 5)
            for n in lengths] == expected


def test_too_short_audio_and_conflicting_settings_are_refused(tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match="too short: 256 samples"):
        GraniteSpeechFeatures(**SETTINGS).log_mel(np.zeros(256, np.float32))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"melspec_kwargs": {"n_mels": 64}}))
    with pytest.raises(ConfigError, match="melspec_kwargs"):
        GraniteSpeechFeatures.from_pretrained(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"n_mels": 64, "melspec_kwargs": {"n_mels": 64}}))
    assert GraniteSpeechFeatures.from_pretrained(str(tmp_path)).n_mels == 64
