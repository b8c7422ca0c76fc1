"""Pixtral's vision tower and Mistral 3's projector (asyncllm/models/pixtral.py) equal transformers' on images of
two sizes (2-D axial rotary positions, the 2 x 2 patch merger's order)."""

from __future__ import annotations

import pytest
import torch

from asyncllm.errors import NotBuiltError
from asyncllm.models.pixtral import Mistral3Projector, PixtralVisionTower


def _hf_model():
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from mm_utils import random_model

    text = MistralConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 patch_size=14, image_size=224)
    config = Mistral3Config(vision_config=vision, text_config=text, image_token_id=60, spatial_merge_size=2,
                            vision_feature_layer=-1)
    return random_model(Mistral3ForConditionalGeneration, config, seed=3)


@pytest.mark.parametrize("height, width", [(56, 84), (112, 28)])
def test_tower_and_projector_equal_transformers(height, width):
    hf = _hf_model()
    config = hf.config
    tower = PixtralVisionTower(config.vision_config, config.vision_feature_layer, torch.float32).eval()
    projector = Mistral3Projector(config, torch.float32).eval()
    tower.load_state_dict(hf.model.vision_tower.state_dict())
    projector.load_state_dict(hf.model.multi_modal_projector.state_dict())
    pixels = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = projector(tower(pixels), height // 14, width // 14)
        sizes = torch.tensor([[height, width]] * 2)
        expected = hf.model.get_image_features(pixel_values=pixels, image_sizes=sizes).pooler_output
    assert ours.shape == (2, (height // 28) * (width // 28), 48)
    torch.testing.assert_close(ours.reshape(-1, 48), torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_an_earlier_feature_layer_runs_fewer_layers_and_a_list_is_refused():
    config = _hf_model().config.vision_config
    assert len(PixtralVisionTower(config, -2, torch.float32).transformer.layers) == 2
    assert len(PixtralVisionTower(config, 1, torch.float32).transformer.layers) == 1
    with pytest.raises(NotBuiltError, match="vision_feature_layer"):
        PixtralVisionTower(config, [-1, -2], torch.float32)
