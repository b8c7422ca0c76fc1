"""LightOnOCR's encoder (asyncllm/models/lighton_ocr.py) loaded through the real loader from transformers' layout:
image features equal transformers' ``get_image_features`` on patch grids with an odd side (the 2 x 2 merge drops the
last row or column, as ``unfold`` does), one row per image token its processor writes; decoders other than Qwen3's
are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from lighton_ocr_utils import make_tiny_lighton_ocr

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.models.lighton_ocr import LightOnOcrForConditionalGeneration
from asyncllm.models.loader import load_hf_config, load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_lighton_ocr(tmp_path_factory.mktemp("lighton_ocr"))


@pytest.mark.parametrize("height, width", [(70, 112), (112, 42), (56, 56)])
def test_image_features_equal_transformers(tiny, height, width):
    from transformers import LightOnOcrForConditionalGeneration as HF

    hf_config = load_hf_config(tiny)
    ours = load_model(EngineConfig.create(tiny, max_model_len=64), hf_config, torch.device("cpu"), torch.float32)
    assert isinstance(ours, LightOnOcrForConditionalGeneration)
    hf = HF.from_pretrained(tiny, dtype=torch.float32).eval()
    pixels = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(height + width))
    with torch.no_grad():
        got = ours.embed_multimodal(pixels)
        expected = hf.model.get_image_features(pixel_values=pixels, image_sizes=torch.tensor([[height, width]]))
    tokens = (height // 28) * (width // 28)
    assert got.shape == (1, tokens, 64)
    assert LightOnOcrForConditionalGeneration.mm_placeholder_length(hf_config, (3, height, width)) == tokens
    torch.testing.assert_close(got[0], torch.cat(expected.pooler_output), rtol=1e-5, atol=1e-5)


def test_a_decoder_other_than_qwen3_is_refused(tiny, tmp_path):
    import shutil

    shutil.copytree(tiny, tmp_path / "other", dirs_exist_ok=True)
    with open(tmp_path / "other" / "config.json") as f:
        config = json.load(f)
    config["text_config"]["model_type"] = "qwen2"
    with open(tmp_path / "other" / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(NotBuiltError, match="text_config.model_type.*LightOnOCR decoder of type qwen3"):
        load_model(EngineConfig.create(str(tmp_path / "other"), max_model_len=64),
                   load_hf_config(str(tmp_path / "other")), torch.device("cpu"), torch.float32)
