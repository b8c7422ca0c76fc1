"""Gemma 4's audio tower (asyncllm/models/gemma4_audio.py) against transformers' ``get_audio_features``: each audio
alone (as the engine encodes it) gives the rows transformers gives it padded beside a longer one, for the release's
attention geometry (the context as far back as a chunk is long) and another (a right context, a shorter left one);
the placeholder count is ``Gemma4Processor``'s."""

from __future__ import annotations

import pytest
import torch
from audio_utils import make_audio
from gemma4_audio_utils import AUDIO, hf_gemma4_audio_inputs, make_tiny_gemma4_audio

from asyncllm.models.checkpoint import load_hf_config
from asyncllm.models.gemma4_audio import Gemma4AudioTower
from asyncllm.models.gemma4_mm import Gemma4ForConditionalGeneration
from asyncllm.models.gemma4_vision import Gemma4MultimodalEmbedder


def _ours(path: str, hf_state: dict) -> torch.nn.Module:
    """Our tower and embedder with transformers' weights (every one of theirs read)."""
    cfg = load_hf_config(path)
    model = torch.nn.Module()
    model.audio_tower = Gemma4AudioTower(cfg.audio_config, torch.float32)
    model.embed_audio = Gemma4MultimodalEmbedder(cfg.audio_config, cfg.text_config.hidden_size, torch.float32)
    ours = dict(model.named_parameters())
    theirs = {name: value for name, value in hf_state.items() if name.startswith(("audio_tower.", "embed_audio."))}
    assert set(ours) == set(theirs)
    for name, param in ours.items():
        param.data.copy_(theirs[name])
    return model


@pytest.mark.parametrize("geometry", [dict(chunk=4, left=5, right=0), dict(chunk=6, left=4, right=2)])
def test_audio_rows_equal_transformers(tmp_path, geometry: dict) -> None:
    from transformers import AutoFeatureExtractor
    from transformers import Gemma4ForConditionalGeneration as HFGemma4

    path = make_tiny_gemma4_audio(tmp_path / "gemma4", **geometry)
    hf = HFGemma4.from_pretrained(path, dtype=torch.float32).eval()
    audios = [make_audio(1.3, seed=1), make_audio(0.7, seed=2)]
    inputs = hf_gemma4_audio_inputs(path, f"{AUDIO}{AUDIO}", audios)
    with torch.no_grad():
        out = hf.model.get_audio_features(inputs["input_features"], inputs["input_features_mask"], return_dict=True)
    model = _ours(path, hf.model.state_dict())
    extractor = AutoFeatureExtractor.from_pretrained(path)
    cfg = load_hf_config(path)
    placeholders = inputs["input_ids"][0].tolist().count(cfg.audio_token_id)
    counts = []
    for i, audio in enumerate(audios):
        values = Gemma4ForConditionalGeneration.mm_audio_values(extractor([audio], return_tensors="np"))
        counts.append(Gemma4ForConditionalGeneration.mm_placeholder_length_of(cfg, values))
        with torch.no_grad():
            rows = Gemma4ForConditionalGeneration.embed_multimodal(model, torch.from_numpy(values)[None])[0]
        expected = out.pooler_output[i][out.attention_mask[i]]
        assert rows.shape == expected.shape == (counts[-1], cfg.text_config.hidden_size)
        torch.testing.assert_close(rows, expected, rtol=0, atol=2e-5)  # float32 noise; the rows are O(1)
    assert counts == [33, 18] and sum(counts) == placeholders
