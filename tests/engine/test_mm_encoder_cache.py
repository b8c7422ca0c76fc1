"""Encoder outputs cached across requests (mm_encoder_cache_gb). mm_encoder_tp_mode="data" at TP=2: LLaVA's split
in tests/unit/test_encoder_cache.py, an engine's in tests/engine/test_qwen_vl_versions_engine.py (Qwen2-VL)."""

from __future__ import annotations

import asyncio

import pytest
from mm_utils import NUM_IMAGE_TOKENS, hf_llava_greedy, make_image, make_tiny_llava

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.outputs import EngineStats, RequestOutput

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
ONE_IMAGE_GB = NUM_IMAGE_TOKENS * 64 * 4 / 2**30
"""The encoder output of one image of the tiny LLaVA (16 rows x 64 hidden x fp32), in GiB."""


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


async def _stats_after(engine: AsyncEngine, queries: int) -> EngineStats:
    """The stats once the core has counted ``queries`` encoder-cache lookups (stats ride on outputs)."""
    for _ in range(500):
        stats = engine.stats()
        if stats.mm_encoder_cache_queries >= queries:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"the encoder cache never counted {queries} lookups: {engine.stats()}")


async def _generate_checked(engine: AsyncEngine, path: str, text: str, images: list[bytes]) -> RequestOutput:
    """The engine's greedy output, its prompt and tokens asserted equal to transformers'."""
    out = await engine.generate({"prompt": text, "images": images}, GREEDY)
    hf_prompt, hf_tokens = hf_llava_greedy(path, text, images, GREEDY.max_tokens)
    assert out.prompt_token_ids == hf_prompt
    assert out.outputs[0].token_ids == hf_tokens
    return out


async def test_the_same_image_after_other_text_is_not_encoded_again(tiny_llava):
    image = make_image(60, 40, seed=21)
    async with AsyncEngine(tiny_llava, disable_log_stats=True, block_size=4, max_num_batched_tokens=6,
                           enable_prefix_caching=True) as engine:
        await _generate_checked(engine, tiny_llava, "Describe <image> please", [image])
        first = await _stats_after(engine, 1)
        assert (first.mm_encoder_cache_queries, first.mm_encoder_cache_hits) == (1, 0)
        text = "A rather different preamble, then <image> and a question?"
        out = await _generate_checked(engine, tiny_llava, text, [image])
        assert out.num_cached_tokens <= out.prompt_token_ids.index(_image_token(out.prompt_token_ids))
        second = await _stats_after(engine, 2)
        assert (second.mm_encoder_cache_queries, second.mm_encoder_cache_hits) == (2, 1)  # no second tower run


def _image_token(prompt_token_ids: list[int]) -> int:
    """The placeholder token: the one repeated NUM_IMAGE_TOKENS times in a row."""
    for i in range(len(prompt_token_ids) - NUM_IMAGE_TOKENS + 1):
        if len(set(prompt_token_ids[i : i + NUM_IMAGE_TOKENS])) == 1:
            return prompt_token_ids[i]
    raise AssertionError("no image placeholders in the prompt")


async def test_a_tiny_budget_evicts_and_still_gives_the_transformers_tokens(tiny_llava):
    x, y, z = (make_image(50, 50, seed=s) for s in (31, 32, 33))
    async with AsyncEngine(tiny_llava, disable_log_stats=True, block_size=4, max_num_batched_tokens=6,
                           max_num_seqs=4, mm_encoder_cache_gb=ONE_IMAGE_GB) as engine:
        await _generate_checked(engine, tiny_llava, "one <image>", [x])
        await _generate_checked(engine, tiny_llava, "two <image>", [y])  # x is evicted for y
        await _generate_checked(engine, tiny_llava, "three <image>", [x])  # encoded again, evicting y
        await _generate_checked(engine, tiny_llava, "four <image>", [x])  # the one cached image: a hit
        stats = await _stats_after(engine, 4)
        assert (stats.mm_encoder_cache_queries, stats.mm_encoder_cache_hits) == (4, 1)
        # two prompts of two images each at once, chunked 6 tokens a step: four images in flight on a
        # one-image budget; every one stays pinned until its prefill has passed it
        texts = ["<image> left <image>", "up <image> down <image>"]
        pairs = [[y, z], [z, x]]
        outs = await asyncio.gather(*(engine.generate({"prompt": t, "images": p}, GREEDY) for t, p in zip(texts, pairs)))
        for out, text, pair in zip(outs, texts, pairs):
            assert out.outputs[0].token_ids == hf_llava_greedy(tiny_llava, text, pair, GREEDY.max_tokens)[1]
