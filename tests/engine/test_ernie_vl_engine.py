"""ERNIE 4.5 VL (``Ernie4_5_VLMoeForConditionalGeneration``) end to end: prompt ids and greedy tokens equal
transformers' for two images of different shapes split across prefill chunks beside a text-only request, and on a
prefix-cache hit, and for a video (its frames stamped with their times) alone and after an image; the modality routing
(markers included) and the M-RoPE positions shown to matter."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from ernie_vl_utils import (
    IMAGE,
    IMAGE_PLACEHOLDER,
    SPECIAL_TOKENS,
    VIDEO,
    VIDEO_PLACEHOLDER,
    hf_ernie_vl_greedy,
    hf_ernie_vl_inputs,
    make_tiny_ernie_vl,
)
from mm_utils import hf_generate, make_image
from qwen_vl_utils import make_video

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8
"""max_num_batched_tokens: fewer than every image's placeholders, so each image is split across steps."""
IMAGES = [make_image(120, 90, seed=1), make_image(60, 200, seed=2)]  # 6 x 8 and 14 x 4 patch grids
TEXT = f"Describe {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER}"
"""Ending at an image's end marker, whose experts (vision) then decide the first token."""
VIDEO_TEXT = f"Watch {VIDEO_PLACEHOLDER}"


@pytest.fixture(scope="module")
def ernie_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_ernie_vl(tmp_path_factory.mktemp("ernie_vl"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(ernie_vl: str):
    async with AsyncEngine(ernie_vl, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


async def test_images_beside_text_then_a_prefix_hit_match_transformers(engine, ernie_vl):
    prompts = [{"prompt": TEXT, "images": IMAGES}, "a text prompt with no image at all"]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate(prompts[0], GREEDY)  # its prefix, images included, from the cache
    hf_prompt, hf_tokens = hf_ernie_vl_greedy(ernie_vl, TEXT, IMAGES, 8)
    hf_text_prompt, hf_text = hf_ernie_vl_greedy(ernie_vl, prompts[1], [], 8)
    assert [o.prompt_token_ids for o in outs] == [hf_prompt, hf_text_prompt]
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_text]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens
    assert hf_prompt.count(engine.tokenizer.convert_tokens_to_ids(IMAGE)) == 12 + 14 > 2 * BUDGET  # 2 x 2 patches
    markers = set(engine.tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS))
    assert markers & set(hf_tokens)  # a generated marker: text experts in both (a vision one only in the prompt)


async def test_modality_routing_and_positions_change_transformers_tokens(ernie_vl):
    """transformers' tokens change when every row runs the text experts, when only the placeholders (not the
    image's start and end markers) run the vision ones, and with plain 1-D positions: the test above checks all."""
    import torch
    from transformers import Ernie4_5_VLMoeForConditionalGeneration

    model = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(ernie_vl, dtype=torch.float32).eval()
    inputs = hf_ernie_vl_inputs(ernie_vl, TEXT, IMAGES)
    expected = hf_generate(model, inputs, 8)[1]
    variants = [{"moe_mm_token_type_ids": torch.zeros_like(inputs["input_ids"])},
                {"moe_mm_token_type_ids": inputs["mm_token_type_ids"]},
                {"position_ids": torch.arange(inputs["input_ids"].shape[1])[None]}]
    assert all(hf_generate(model, {**inputs, **variant}, 8)[1] != expected for variant in variants)


async def test_videos_beside_an_image_and_text_then_a_prefix_hit_match_transformers(engine, ernie_vl):
    """Nine stamped frames (padded to ten: five frame pairs, more than the frames' rows or columns, so the text
    after the video resumes by transformers' rule), alone and after an image, beside a text-only request."""
    video = (make_video(9, 90, 60, seed=3), {"fps": 2.0, "frames_indices": list(range(0, 27, 3)),
                                             "total_num_frames": 27})
    prompts = [{"prompt": VIDEO_TEXT, "videos": [video]},
               {"prompt": f"First {IMAGE_PLACEHOLDER}, {VIDEO_TEXT}", "images": IMAGES[:1], "videos": [video]},
               "a text prompt with no video at all"]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate(prompts[1], GREEDY)  # its prefix, image and video included, from the cache
    expected = [hf_ernie_vl_greedy(ernie_vl, VIDEO_TEXT, [], 8, [video]),
                hf_ernie_vl_greedy(ernie_vl, prompts[1]["prompt"], IMAGES[:1], 8, [video]),
                hf_ernie_vl_greedy(ernie_vl, prompts[2], [], 8)]
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == expected
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == expected[1][1]
    video_id = engine.tokenizer.convert_tokens_to_ids(VIDEO)
    assert expected[0][0].count(video_id) == 5 * 2 * 3 > 2 * BUDGET  # frame pairs x 2 x 3 merged patches
