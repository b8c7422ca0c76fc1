"""Aria's encoder (asyncllm/models/aria.py) loaded through the real loader from the released layout: image features
equal transformers' ``get_image_features`` for padded crops (masked patches, their bucketized positions) and split
crops, one row per image token its processor writes; stacked experts of another shape are refused by name."""

from __future__ import annotations

import io

import pytest
import torch
from aria_utils import IMAGE, make_tiny_aria
from mm_utils import make_image

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.aria import AriaForConditionalGeneration, AriaTextForCausalLM
from asyncllm.models.loader import load_hf_config, load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_aria(tmp_path_factory.mktemp("aria"))


@pytest.mark.parametrize("width, height, kwargs", [(100, 60, {}), (50, 112, {}), (64, 64, {}),
                                                   (1000, 420, {"split_image": True, "max_image_size": 490})])
def test_image_features_equal_transformers(tiny, width, height, kwargs):
    from PIL import Image
    from transformers import AriaForConditionalGeneration as HF
    from transformers import AutoProcessor

    hf_config = load_hf_config(tiny)
    ours = load_model(EngineConfig.create(tiny, max_model_len=64), hf_config, torch.device("cpu"), torch.float32)
    assert isinstance(ours, AriaForConditionalGeneration)
    hf = HF.from_pretrained(tiny, dtype=torch.float32).eval()
    image = Image.open(io.BytesIO(make_image(width, height, seed=width))).convert("RGB")
    processed = AutoProcessor.from_pretrained(tiny)(text=[IMAGE], images=[image], return_tensors="np", **kwargs)
    pixels = AriaForConditionalGeneration.mm_pixel_values(processed)
    with torch.no_grad():
        got = ours.embed_multimodal(torch.from_numpy(pixels)[None])
        expected = hf.model.get_image_features(pixel_values=torch.from_numpy(processed["pixel_values"]),
                                               pixel_mask=torch.from_numpy(processed["pixel_mask"])).pooler_output
    tokens = int((processed["input_ids"] == hf_config.image_token_id).sum())
    assert AriaForConditionalGeneration.mm_placeholder_length(hf_config, pixels.shape) == tokens == got.shape[1]
    torch.testing.assert_close(got[0], expected.reshape(-1, 64), rtol=1e-5, atol=1e-5)


def test_stacked_experts_of_another_shape_are_refused(tiny):
    hf_config = load_hf_config(tiny)
    ours = load_model(EngineConfig.create(tiny, max_model_len=64), hf_config, torch.device("cpu"), torch.float32)
    decoder = ours.language_model
    assert isinstance(decoder, AriaTextForCausalLM)
    wrong = torch.zeros(8, 48, 128)  # [E, I, 2H]: not [E, hidden, 2I]
    with pytest.raises(ConfigError, match=r"Aria's stacked experts of shape \[8, 64, 96\]"):
        decoder.load_weights([("model.layers.0.mlp.experts.fc1.weight", wrong)])


def test_an_adapter_on_the_shared_experts_is_refused(tiny, tmp_path):
    """LoRA takes the decoder's attention (tests/unit/test_lora_models.py); the experts' MLPs, shared ones too, are
    refused by name, never left unread."""
    from lora_utils import make_adapter
    from transformers import AriaForConditionalGeneration as HF

    from asyncllm import LoRARequest
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import InvalidRequestError

    adapter = make_adapter(tiny, str(tmp_path / "adapter"), seed=1, rank=4, auto_class=HF,
                           targets=r"model\.language_model\.layers\.\d+\.mlp\.shared_experts\.\w+_proj")
    checker = prepare(EngineConfig.create(tiny, enable_lora=True, max_lora_rank=8)).lora
    with pytest.raises(InvalidRequestError, match="shared_experts.*adapters on the experts of this model are not built"):
        checker.check(LoRARequest("shared", 1, adapter))
