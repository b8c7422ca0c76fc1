"""Voxtral's host features and placeholder count (asyncllm/models/voxtral.py) against transformers'
``VoxtralProcessor``'s feature code, and its refusal of a projector width that does not stack whole rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from asyncllm.errors import NotBuiltError
from asyncllm.models.voxtral import VoxtralForConditionalGeneration as Voxtral
from asyncllm.models.voxtral import voxtral_stack

SAMPLING_RATE = 16_000


def _host_values(extractor, waveform: np.ndarray) -> np.ndarray:
    """The item values the host makes of ``waveform`` (asyncllm/mm/media_items.py's call)."""
    processed = extractor(Voxtral.mm_audio_windows(waveform, SAMPLING_RATE), sampling_rate=SAMPLING_RATE,
                          return_tensors="np", **Voxtral.mm_audio_extractor_kwargs)
    return Voxtral.mm_audio_values(processed)


@pytest.mark.parametrize("seconds", [0.7, 30.0, 61.5])
def test_features_equal_the_processors_windows(seconds: float) -> None:
    """One log-mel pass over the audio padded to whole 30 s windows, then cut: not one pass per window (the
    normalisation and the frames at each cut would differ)."""
    from transformers import VoxtralProcessor, WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=SAMPLING_RATE)
    rng = np.random.default_rng(int(seconds * 10))
    waveform = (0.3 * rng.standard_normal(int(seconds * SAMPLING_RATE))).astype(np.float32)
    waveform[: SAMPLING_RATE // 2] *= 0.01  # a quiet start: a window's own normalisation floor differs
    kwargs = {k: v for k, v in VoxtralProcessor.audio_kwargs.items() if k != "max_source_positions"}
    expected = VoxtralProcessor._retrieve_input_features(SimpleNamespace(feature_extractor=extractor), [waveform],
                                                         3000, **kwargs).numpy()
    values = _host_values(extractor, waveform)
    assert values.shape == expected.shape == (-(-waveform.size // 480_000), 16, 3000)
    np.testing.assert_array_equal(values, expected)


def test_placeholders_are_375_per_window_and_a_bad_stack_is_refused() -> None:
    audio = SimpleNamespace(hidden_size=32, intermediate_size=128, max_source_positions=1500)
    config = SimpleNamespace(audio_config=audio)
    assert Voxtral.mm_placeholder_length_of(config, np.zeros((3, 16, 3000), np.float32)) == 3 * 375
    with pytest.raises(NotBuiltError, match="intermediate_size"):
        voxtral_stack(SimpleNamespace(hidden_size=32, intermediate_size=100, max_source_positions=1500))
    with pytest.raises(NotBuiltError, match="k dividing max_source_positions"):
        voxtral_stack(SimpleNamespace(hidden_size=32, intermediate_size=224, max_source_positions=1500))
    with pytest.raises(NotBuiltError, match="max_source_positions=750"):  # the windows are 3000 frames
        Voxtral.build_encoder(SimpleNamespace(hidden_size=32, intermediate_size=128, max_source_positions=750), None)


def test_the_encoder_equals_transformers_and_keeps_its_positions_in_float32() -> None:
    """Rows equal transformers' ``VoxtralEncoder``'s over padded windows (every frame attended); built in bfloat16,
    the positions stay float32 (transformers' ``_keep_in_fp32_modules_strict``) and the rows come out bfloat16."""
    import torch
    from transformers import VoxtralEncoderConfig
    from transformers.models.voxtral.modeling_voxtral import VoxtralEncoder as HFEncoder

    from asyncllm.models.voxtral import VoxtralEncoder

    cfg = VoxtralEncoderConfig(num_mel_bins=16, num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                               intermediate_size=128, max_source_positions=1500)
    torch.manual_seed(0)
    reference = HFEncoder(cfg).eval()
    ours = VoxtralEncoder(cfg, torch.float32)
    ours.load_state_dict(reference.state_dict())
    features = torch.randn(2, 16, 3000)
    features[1, :, 1000:] = -0.5  # a padded tail, attended as transformers attends it
    with torch.no_grad():
        torch.testing.assert_close(ours(features), reference(features).last_hidden_state, rtol=1e-5, atol=1e-5)
        half = VoxtralEncoder(cfg, torch.bfloat16)
        assert half.embed_positions.weight.dtype == torch.float32
        assert half(features.bfloat16()).dtype == torch.bfloat16
