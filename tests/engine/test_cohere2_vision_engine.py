"""Command A Vision end to end (one engine): each tile its own item between the processor's tokens
(``<|START_OF_IMG|>``, ``<|IMG_LINE_BREAK|>`` after each tile, ``<|END_OF_IMG|>``), prompt ids and greedy tokens equal
transformers' for one and several images and text alone, across chunks, batches and prefix-cache hits."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from cohere2_vision_utils import IMAGE, NAMED, hf_cohere2_vision_greedy, make_tiny_cohere2_vision
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
TEXT = "A text-only prompt, long enough for chunks"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_cohere2_vision(tmp_path_factory.mktemp("cohere2_vision"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny: str):
    async with AsyncEngine(tiny, disable_log_stats=True, block_size=4, max_num_batched_tokens=8,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


def token_ids(path: str) -> dict[str, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return {name: tokenizer.convert_tokens_to_ids(text) for name, text in NAMED.items()}


PROMPTS = {  # name: (text, images as (width, height, seed))
    "one tile": (f"Describe {IMAGE} please", [(40, 40, 1)]),
    "3 x 1 and thumbnail": (f"Describe {IMAGE} please", [(150, 60, 2)]),
    "two images": (f"{IMAGE} and {IMAGE}", [(150, 60, 7), (60, 130, 8)]),
    "text alone": (TEXT, []),
}


async def test_images_and_text_in_one_batch_match_transformers(engine, tiny):
    """One tile alone, 3 x 1 tiles plus the thumbnail, two images in one prompt, a text-only prompt and a chat image
    part (through the checkpoint's template), all batched together across 8-token chunks: prompt ids and greedy
    tokens equal transformers'; then the two-image prompt again from the caches (its tiles cross as keys, its
    prefix is cached)."""
    images = {name: [make_image(*size) for size in sizes] for name, (_, sizes) in PROMPTS.items()}
    image = make_image(120, 50, seed=5)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "What is it?"}]}]
    stream = engine.chat(messages, GREEDY)

    async def chat() -> list[int]:
        return [token for delta in [d async for d in stream] for token in delta.token_ids]

    *outs, tokens = await asyncio.gather(*(engine.generate({"prompt": text, "images": images[name]}, GREEDY)
                                           for name, (text, _) in PROMPTS.items()), chat())
    expected = {name: hf_cohere2_vision_greedy(tiny, text, images[name], 8) for name, (text, _) in PROMPTS.items()}
    for name, out in zip(PROMPTS, outs):
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected[name], name
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    assert (stream.collector.prompt_token_ids, tokens) == hf_cohere2_vision_greedy(tiny, None, [image], 8,
                                                                                   messages=hf_messages)
    ids = token_ids(tiny)
    for name, tiles, rows in [("one tile", 1, 4), ("3 x 1 and thumbnail", 4, 16), ("two images", 4 + 4, 32)]:
        prompt = expected[name][0]
        assert (prompt.count(ids["img_line_break_token"]), prompt.count(ids["image_token"])) == (tiles, rows), name
    again = await engine.generate({"prompt": PROMPTS["two images"][0], "images": images["two images"]}, GREEDY)
    assert again.outputs[0].token_ids == expected["two images"][1]
    assert again.num_cached_tokens > 0
