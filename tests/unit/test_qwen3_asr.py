"""Qwen3-ASR's encoder and placeholder count (asyncllm/models/qwen3_asr.py) against transformers'
``Qwen3ASRForConditionalGeneration.get_audio_features`` and ``Qwen3ASRProcessor``."""

from __future__ import annotations

import pytest
import torch

from asyncllm.errors import ConfigError
from asyncllm.models.qwen3_asr import Qwen3ASREncoder, Qwen3ASRProjector, qwen3_asr_output_length


def _hf_model(n_window_infer: int = 200):
    from mm_utils import random_model
    from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    encoder = dict(model_type="qwen3_asr_encoder", num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2,
                   encoder_ffn_dim=64, d_model=32, output_dim=48, downsample_hidden_size=8,
                   n_window_infer=n_window_infer)
    decoder = dict(model_type="qwen3", vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    config = Qwen3ASRConfig(audio_config=encoder, text_config=decoder)
    return random_model(Qwen3ASRForConditionalGeneration, config, seed=0).float()


def test_placeholders_equal_the_processors_count() -> None:
    from transformers import Qwen3ASRProcessor

    for frames in (1, 7, 50, 99, 100, 101, 270, 430, 800, 801, 3000, 12345):
        expected = int(Qwen3ASRProcessor._get_audio_token_length(None, torch.tensor(frames)))
        assert qwen3_asr_output_length(frames, 50) == expected, frames


@pytest.mark.parametrize("lengths", [[430, 270, 50], [100], [37]])
def test_encoder_rows_equal_transformers(lengths: list[int]) -> None:
    """Audios of whole chunks, a part, several attention windows (26 rows each) and shorter than a chunk, batched
    (the padded frames hold noise: a part chunk's convolutions read it in both): the projected rows of each, in order."""
    hf = _hf_model()
    tower = Qwen3ASREncoder(hf.config.audio_config, torch.float32)
    projector = Qwen3ASRProjector(hf.config, torch.float32)
    state = hf.model.state_dict()
    tower.load_state_dict({k.removeprefix("audio_tower."): v for k, v in state.items() if k.startswith("audio_tower.")})
    projector.load_state_dict({k.removeprefix("multi_modal_projector."): v for k, v in state.items()
                               if k.startswith("multi_modal_projector.")})
    frames = -(-max(lengths) // 100) * 100
    torch.manual_seed(1)
    features = torch.randn(len(lengths), 16, frames)
    mask = (torch.arange(frames)[None, :] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        expected = hf.model.get_audio_features(features, mask).pooler_output
        rows = torch.cat([projector(r) for r in tower(features, lengths)])
    assert rows.shape == expected.shape == (sum(qwen3_asr_output_length(n, 50) for n in lengths), 48)
    torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)


def test_a_window_not_a_multiple_of_the_chunk_is_refused() -> None:
    hf = _hf_model()
    hf.config.audio_config.n_window_infer = 150
    with pytest.raises(ConfigError, match="n_window_infer"):
        Qwen3ASREncoder(hf.config.audio_config, torch.float32)


def test_features_padded_for_another_chunk_are_refused() -> None:
    """A feature extractor whose ``n_window`` is not the model's (frames not in whole chunks) fails by name."""
    import numpy as np
    from transformers import Qwen3ASRConfig

    from asyncllm.models.qwen3_asr import Qwen3ASRForConditionalGeneration

    config = Qwen3ASRConfig()
    values = np.zeros((1, 129, 300), np.float32)
    values[0, -1, :270] = 1
    assert Qwen3ASRForConditionalGeneration.mm_placeholder_length_of(config, values) == 35
    with pytest.raises(ConfigError, match="n_window"):
        Qwen3ASRForConditionalGeneration.mm_placeholder_length_of(config, values[..., :250])
