"""Phi-4-multimodal's preprocessing and encoders in process against transformers: the HD crops, their patch masks and
token counts (`Phi4MultimodalImages`, the model's placeholder lengths), the audio placeholders, the image and audio
rows (both audio projections, and an audio past one 500-row attention chunk)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from mm_utils import make_image, random_model
from phi4_mm_utils import PROCESSOR, hf_phi4_image_processor, tiny_phi4_mm_config

from asyncllm.errors import NotBuiltError
from asyncllm.mm.phi4_mm_images import Phi4MultimodalImages, Phi4MultimodalImageSettings, unpack_views
from asyncllm.models.phi4_mm_audio import Phi4AudioEmbedding
from asyncllm.models.phi4_multimodal import Phi4ImageEmbedding, Phi4MultimodalForCausalLM

SIZES = [(600, 250), (100, 900), (2000, 500)]
"""(width, height): 2 x 1 crops with padding rows, 1 x 3 with padding columns, a grid fitted to 4 crops."""
VISION = SimpleNamespace(vision_config=SimpleNamespace(image_size=448, patch_size=14, crop_size=448),
                         audio_config=SimpleNamespace(time_reduction=8))


def _pil(image: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(image)).convert("RGB")


def test_crops_masks_and_token_counts_equal_transformers() -> None:
    hf = hf_phi4_image_processor(**PROCESSOR)
    ours = Phi4MultimodalImages(Phi4MultimodalImageSettings(dynamic_hd=PROCESSOR["dynamic_hd"]))
    for width, height in SIZES:
        image = _pil(make_image(width, height, seed=width))
        expected = hf([image], return_tensors="pt")
        values = ours([image])
        views, masks, cols = unpack_views(values[None], 448, 32)
        torch.testing.assert_close(torch.from_numpy(views[0]), expected["image_pixel_values"][0], atol=0, rtol=0)
        assert (masks[0] == expected["image_attention_mask"][0].numpy()).all(), (width, height)
        assert int(cols[0, 0]) * 448 == int(expected["image_sizes"][0, 1])
        placeholders = Phi4MultimodalForCausalLM.mm_placeholder_length_of(VISION, values)
        assert placeholders == int(expected["num_img_tokens"][0]), (width, height)


def test_audio_placeholders_equal_transformers() -> None:
    from transformers import Phi4MultimodalFeatureExtractor

    extractor = Phi4MultimodalFeatureExtractor()
    for samples in (400, 401, 1999, 16000, 16000 * 3 + 37):
        wave = np.random.default_rng(samples).standard_normal(samples).astype(np.float32)
        processed = extractor([wave], sampling_rate=16000, return_tensors="np")
        values = Phi4MultimodalForCausalLM.mm_audio_with_images(Phi4MultimodalForCausalLM.mm_audio_values(processed),
                                                                True)
        assert values.shape[-1] == 81 and (values[..., -1] == 1.0).all()
        assert Phi4MultimodalForCausalLM.mm_placeholder_length_of(VISION, values) == int(
            processed["audio_embed_sizes"][0]), samples


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Phi4MultimodalForCausalLM as HF

    config = tiny_phi4_mm_config(64, image_id=60, audio_id=61)
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    return random_model(HF, config, seed=1)


class _ScalarReads(TorchDispatchMode):
    """Counts the tensor -> Python scalar reads (``int``, ``bool``, ``.item()``: a device sync each) while it is on."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _ours(module_cls, hf_model, prefix: str):
    module = module_cls(hf_model.config, torch.float32)
    state = {k.removeprefix(prefix): v for k, v in hf_model.state_dict().items() if k.startswith(prefix)}
    module.load_state_dict({k: v for k, v in state.items() if k in module.state_dict()}, strict=True)
    return module


def test_image_rows_equal_transformers(hf_model) -> None:
    """A 2 x 1 image with padding rows: each row equal transformers' (the crops cut, the separators, the global view)."""
    ours = _ours(Phi4ImageEmbedding, hf_model, "model.embed_tokens_extend.image_embed.")
    image = _pil(make_image(600, 250, seed=3))
    expected_inputs = hf_phi4_image_processor(**PROCESSOR)([image], return_tensors="pt")
    values = Phi4MultimodalImages(Phi4MultimodalImageSettings(dynamic_hd=4))([image])
    count = int(expected_inputs["num_img_tokens"][0])
    ids = torch.full((1, count), hf_model.config.vision_config.image_token_id)
    with torch.no_grad():
        expected = hf_model.model.embed_tokens_extend.image_embed(
            ids, torch.zeros(1, count, 64), expected_inputs["image_pixel_values"], expected_inputs["image_sizes"],
            expected_inputs["image_attention_mask"])[0]
        with _ScalarReads() as reads:  # the grid read once per batch (`.tolist()`), never per image
            rows = ours(torch.from_numpy(values)[None])[0]
    assert reads.count == 0
    torch.testing.assert_close(rows, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seconds", [1.0, 41.0])
def test_audio_rows_equal_transformers(hf_model, seconds: float) -> None:
    """Speech and vision-speech projections; 41 s is 513 rows: two 500-row chunks, the last padded."""
    from transformers import Phi4MultimodalFeatureExtractor

    ours = _ours(Phi4AudioEmbedding, hf_model, "model.embed_tokens_extend.audio_embed.")
    wave = (np.random.default_rng(5).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)
    processed = Phi4MultimodalFeatureExtractor()([wave], sampling_rate=16000, return_tensors="pt")
    count = int(processed["audio_embed_sizes"][0])
    ids = torch.full((1, count), hf_model.config.audio_config.audio_token_id)
    for with_images, mode in ((False, "speech"), (True, "vision")):
        values = Phi4MultimodalForCausalLM.mm_audio_with_images(
            Phi4MultimodalForCausalLM.mm_audio_values({k: v.numpy() for k, v in processed.items()}), with_images)
        with torch.no_grad():
            expected = hf_model.model.embed_tokens_extend.audio_embed(
                ids, torch.zeros(1, count, 64), processed["audio_input_features"], processed["audio_embed_sizes"],
                None, mode)[0]
            with _ScalarReads() as reads:  # the modes read once per batch (`.tolist()`), never per audio
                rows = ours(torch.from_numpy(values)[None])[0]
        assert reads.count == 0 and rows.shape == expected.shape
        torch.testing.assert_close(rows, expected, atol=1e-4, rtol=0)


def test_stacked_audio_rows_are_not_built(hf_model) -> None:
    config = tiny_phi4_mm_config(64, image_id=60, audio_id=61)
    config.audio_config.downsample_rate = 2
    with pytest.raises(NotBuiltError, match="downsample_rate"):
        Phi4AudioEmbedding(config, torch.float32)
