"""Granite Speech's audio encoder and projector (asyncllm/models/granite_speech.py): their rows equal transformers'
``get_audio_features`` within float32 noise for lengths that leave the last attention block and the last projector
window partly padded, two audios of one length batched."""

from __future__ import annotations

import pytest
import torch
from granite_speech_utils import MEL_BINS, tiny_granite_speech_model

from asyncllm.models.granite_speech import GraniteSpeechEncoder, GraniteSpeechProjector


@pytest.mark.parametrize("frames", [37, 60])  # 20-row attention blocks, 15-row windows: a remainder of 17 or none
def test_encoder_and_projector_rows_equal_transformers(frames: int) -> None:
    hf = tiny_granite_speech_model(vocab_size=64, audio_token_id=63, seed=3)
    config = hf.config
    encoder = GraniteSpeechEncoder(config.encoder_config, torch.float32)
    projector = GraniteSpeechProjector(config, torch.float32)
    states = {name: value for name, value in hf.model.encoder.state_dict().items()
              if not name.endswith("num_batches_tracked")}
    encoder.load_state_dict(states)
    projector.load_state_dict(hf.model.projector.state_dict())
    features = torch.randn(2, frames, 2 * MEL_BINS, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        ours = projector(encoder(features))
        expected = hf.model.get_audio_features(features).pooler_output
    assert ours.shape == expected.shape == (2, -(-frames // 15) * 3, 64)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
