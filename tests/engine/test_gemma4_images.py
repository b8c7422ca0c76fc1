"""Gemma 4 with images end to end (asyncllm/models/gemma4_mm.py): images of different aspect ratios make different
numbers of rows (the processor keeps the ratio), each image's rows attend to each other both ways in the sliding
layers only; greedy tokens equal transformers' with two images across 80-token chunks (an image of up to 70 rows whole in one) beside a text-only request,
from the prefix cache, and through the KV-sharing layers and per-layer inputs of the tiny decoder."""

from __future__ import annotations

import asyncio

import pytest
from gemma4_mm_utils import IMAGE, hf_gemma4_greedy, make_tiny_gemma4_mm
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_gemma4_mm(tmp_path_factory.mktemp("gemma4"))


async def test_images_beside_text_in_chunks_and_from_the_prefix_cache_match_transformers(gemma4):
    images = [make_image(40, 28, seed=1), make_image(20, 52, seed=2)]
    text = f"look at {IMAGE} and then at {IMAGE} what are they"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image at all"]
    async with AsyncEngine(gemma4, disable_log_stats=True, block_size=4, max_num_batched_tokens=80, max_num_seqs=4,
                           enable_prefix_caching=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        again = await engine.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
    hf_prompt, hf_tokens = hf_gemma4_greedy(gemma4, text, images, 8)
    assert outs[0].prompt_token_ids == hf_prompt
    rows = [hf_prompt.count(engine.tokenizer.convert_tokens_to_ids(IMAGE))]
    assert rows[0] > 40  # two images, their rows by their shapes
    assert outs[0].outputs[0].token_ids == hf_tokens
    assert hf_tokens != hf_gemma4_greedy(gemma4, text, images, 8, bidirectional=False)[1]  # the mask matters
    assert outs[1].outputs[0].token_ids == hf_gemma4_greedy(gemma4, prompts[1], [], 8)[1]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens


async def test_a_causal_checkpoint_and_text_only_mode(gemma4, tmp_path_factory: pytest.TempPathFactory):
    """Without ``use_bidirectional_attention`` every row is causal (as transformers without the vision mask); with
    ``limit_mm_per_prompt`` of 0 images the language model alone serves text."""
    causal = make_tiny_gemma4_mm(tmp_path_factory.mktemp("causal"), bidirectional=None, standardize=False,
                                 clipped=False)
    image = make_image(36, 36, seed=3)
    text = f"what is {IMAGE} here"
    async with AsyncEngine(causal, disable_log_stats=True, block_size=4, max_num_batched_tokens=80) as engine:
        out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    assert out.outputs[0].token_ids == hf_gemma4_greedy(causal, text, [image], 8, bidirectional=False)[1]
    words = "only words here"
    async with AsyncEngine(gemma4, disable_log_stats=True, limit_mm_per_prompt={"image": 0}) as engine:
        out = await engine.generate(words, GREEDY)
    assert out.outputs[0].token_ids == hf_gemma4_greedy(gemma4, words, [], 8)[1]


async def test_images_over_two_tensor_parallel_ranks(gemma4):
    """The tower and embedder whole on each rank (``mm_encoder_tp_mode`` "data" splits a step's images between
    them), the decoder split: the same tokens."""
    images = [make_image(28, 40, seed=4), make_image(44, 20, seed=5)]
    text = f"{IMAGE} and {IMAGE}"
    async with AsyncEngine(gemma4, disable_log_stats=True, tensor_parallel_size=2, max_num_batched_tokens=160,
                           mm_encoder_tp_mode="data") as engine:
        out = await engine.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == hf_gemma4_greedy(gemma4, text, images, 8)[1]
