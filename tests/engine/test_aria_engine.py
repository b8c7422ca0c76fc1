"""Aria (Idefics3 tower, cross-attention projector, fine-grained MoE decoder) end to end: prompts expanded as
transformers' ``AriaProcessor`` expands them (16 image tokens a 980-pixel crop), greedy tokens equal transformers'
for two images of other aspect ratios (padded crops: masked patches) split across prefill chunks beside a text-only
request, from the prefix cache, over two pipeline stages and two tensor-parallel ranks."""

from __future__ import annotations

import asyncio

import pytest
from aria_utils import IMAGE, hf_aria_greedy, make_tiny_aria
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def aria(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_aria(tmp_path_factory.mktemp("aria"))


async def test_images_beside_text_and_from_the_prefix_cache_match_transformers(aria):
    images = [make_image(100, 60, seed=1), make_image(50, 112, seed=2)]
    text = f"look {IMAGE} and {IMAGE} please"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image"]
    async with AsyncEngine(aria, disable_log_stats=True, block_size=4, max_num_batched_tokens=8,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        again = await engine.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
    hf_prompt, hf_tokens = hf_aria_greedy(aria, text, images, 8)
    image_id = engine.tokenizer.convert_tokens_to_ids(IMAGE)
    assert outs[0].prompt_token_ids == hf_prompt and hf_prompt.count(image_id) == 16 + 16
    assert outs[0].outputs[0].token_ids == hf_tokens
    assert outs[1].outputs[0].token_ids == hf_aria_greedy(aria, prompts[1], [], 8)[1]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens


SPLIT = {"split_image": True, "max_image_size": 490}


async def test_a_request_splitting_an_image_into_crops_matches_transformers(aria):
    """``mm_processor_kwargs`` as ``AriaProcessor``'s images kwargs: a 1000 x 420 image cut into 490-pixel crops
    (1 x 3 of them, 8 queries each), one item of three crops; the same image unsplit is another item (980 pixels,
    16 queries)."""
    image = make_image(1000, 420, seed=4)
    text = f"{IMAGE} describe"
    async with AsyncEngine(aria, disable_log_stats=True, block_size=4, max_num_batched_tokens=8,
                           enable_prefix_caching=True) as engine:
        split = await engine.generate({"prompt": text, "images": [image], "mm_processor_kwargs": SPLIT}, GREEDY)
        whole = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_aria_greedy(aria, text, [image], 8, **SPLIT)
    image_id = engine.tokenizer.convert_tokens_to_ids(IMAGE)
    assert split.prompt_token_ids == hf_prompt and hf_prompt.count(image_id) == 3 * 8
    assert split.outputs[0].token_ids == hf_tokens
    assert whole.prompt_token_ids.count(image_id) == 16
    assert whole.outputs[0].token_ids == hf_aria_greedy(aria, text, [image], 8)[1]


@pytest.mark.parametrize("fields", [dict(pipeline_parallel_size=2),
                                    dict(tensor_parallel_size=2, mm_encoder_tp_mode="data")])
async def test_images_run_in_two_pipeline_stages_and_over_two_tensor_parallel_ranks(aria, fields):
    """Two stages, one decoder layer each, the first encoding the images; two ranks splitting the decoder's
    attention and each expert's intermediate rows (the tower whole on each): tokens equal transformers'."""
    images = [make_image(100, 60, seed=3)]
    text = f"{IMAGE} read it"
    async with AsyncEngine(aria, disable_log_stats=True, block_size=4, max_model_len=128,
                           num_gpu_blocks_override=64, max_num_batched_tokens=8, **fields) as engine:
        outs = await asyncio.gather(engine.generate({"prompt": text, "images": images}, GREEDY),
                                    engine.generate("a text prompt beside it", GREEDY))
    assert outs[0].outputs[0].token_ids == hf_aria_greedy(aria, text, images, 8)[1]
    assert outs[1].outputs[0].token_ids == hf_aria_greedy(aria, "a text prompt beside it", [], 8)[1]
