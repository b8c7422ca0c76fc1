"""InternVL (transformers' layout) end to end: tiled images wrapped in ``<img>`` / ``</img>`` that keep their own
embeddings, token for token equal to transformers with images split across prefill chunks beside a text-only
request and from the prefix cache; the tower's features equal transformers'. (Encoding by data over ranks is the
shared path: Qwen-VL's and LLaVA's tests.)"""

from __future__ import annotations

import asyncio

import pytest
import torch
from internvl_utils import IMAGE, hf_internvl_greedy, make_tiny_internvl
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def internvl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_internvl(tmp_path_factory.mktemp("internvl"))


async def test_tiled_images_beside_text_and_from_the_prefix_cache_match_transformers(internvl):
    images = [make_image(120, 60, seed=1), make_image(50, 50, seed=2)]  # 2 tiles + a thumbnail; 1 tile
    text = f"look {IMAGE} and {IMAGE} please"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image"]
    async with AsyncEngine(internvl, disable_log_stats=True, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                           enable_prefix_caching=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        again = await engine.generate(prompts[0], GREEDY)
    hf_prompt, hf_tokens = hf_internvl_greedy(internvl, text, images, 8)
    assert outs[0].prompt_token_ids == hf_prompt and len(hf_prompt) > 8 + 4 * 4
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_internvl_greedy(internvl, prompts[1], [], 8)[1]]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens


async def test_the_tower_shuffle_and_projector_equal_transformers(internvl):
    """q/k norms and biases on, layer scale random: the rows of three tiles within 1e-5 of transformers'."""
    from transformers import AutoModelForImageTextToText

    from asyncllm.models.internvl import InternVisionTower, InternVLProjector, pixel_shuffle

    hf = AutoModelForImageTextToText.from_pretrained(internvl, dtype=torch.float32).eval()
    tower = InternVisionTower(hf.config.vision_config, hf.config.vision_feature_layer, torch.float32).eval()
    tower.load_state_dict(hf.model.vision_tower.state_dict())
    projector = InternVLProjector(hf.config, torch.float32).eval()
    projector.load_state_dict(hf.model.multi_modal_projector.state_dict())
    tiles = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = tower(tiles)[:, 1:]
        rows = projector(pixel_shuffle(features.reshape(3, 4, 4, -1), 0.5).reshape(3, 4, -1))
        expected = hf.model.get_image_features(pixel_values=tiles).pooler_output
    torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)
