"""Gemma 3 with images end to end: each image's 16 rows attend to each other both ways in the prefill (so no
prefill chunk may end inside them), the prompt's newlines merge around the image text as Gemma 3's processor and
tokenizer make them; greedy tokens equal transformers' with two images across 20-token chunks beside a text-only
request, from the prefix cache, and in chat; with pan-and-scan (per engine, per request) each crop is its own
both-ways item in ``Gemma3Processor``'s text, equal to transformers' tokens. Language-model-only mode (``limit_mm_per_prompt`` of 0 images) serves
the text decoder alone (tests/engine/test_gemma_engine.py, LoRA)."""

from __future__ import annotations

import asyncio

import pytest
from gemma3_mm_utils import (
    BOI,
    SOFT,
    hf_gemma3_greedy,
    hf_gemma3_pan_and_scan_greedy,
    hf_gemma3_prompt,
    make_tiny_gemma3_mm,
)
from mm_utils import make_image

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_gemma3_mm(tmp_path_factory.mktemp("gemma3"))


async def test_images_beside_text_in_chunks_from_the_prefix_cache_and_in_chat_match_transformers(gemma3):
    images = [make_image(100, 60, seed=7), make_image(50, 112, seed=8)]  # seeds whose tokens the mask changes
    text = f"look at this\n{BOI} and then at {BOI}\nwhat are they"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image at all"]
    async with AsyncEngine(gemma3, disable_log_stats=True, block_size=4, max_num_batched_tokens=20, max_num_seqs=4,
                           enable_prefix_caching=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        again = await engine.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images[1]}},
                                                 {"type": "text", "text": "what is it?"}]}]
        stream = engine.chat(messages, GREEDY)
        chat_tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    hf_prompt, hf_tokens = hf_gemma3_greedy(gemma3, text, images, 10)
    assert outs[0].prompt_token_ids == hf_prompt
    assert outs[0].outputs[0].token_ids == hf_tokens
    assert hf_tokens != hf_gemma3_greedy(gemma3, text, images, 10, bidirectional=False)[1]  # the mask matters
    assert outs[1].outputs[0].token_ids == hf_gemma3_greedy(gemma3, prompts[1], [], 10)[1]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens
    chat_text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}], tokenize=False,
        add_generation_prompt=True)
    chat_prompt, expected = hf_gemma3_greedy(gemma3, chat_text, [images[1]], 10, add_special_tokens=False)
    newlines3 = engine.tokenizer.convert_tokens_to_ids("\n\n\n")
    assert stream.collector.prompt_token_ids == chat_prompt and newlines3 in chat_prompt  # "user\n" + "\n\n<boi>"
    assert chat_tokens == expected


async def test_an_image_longer_than_a_step_is_refused_and_the_engine_serves_on(gemma3):
    image = make_image(64, 64, seed=3)
    async with AsyncEngine(gemma3, disable_log_stats=True, block_size=4, max_num_batched_tokens=12,
                           max_num_seqs=2) as engine:
        with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
            await engine.generate({"prompt": f"see {BOI}", "images": [image]}, GREEDY)
        text = "still serving text"
        out = await engine.generate(text, GREEDY)
    assert out.outputs[0].token_ids == hf_gemma3_greedy(gemma3, text, [], 10)[1]
    assert out.prompt_token_ids == hf_gemma3_prompt(gemma3, text)


PAN_AND_SCAN = {"do_pan_and_scan": True}


async def test_pan_and_scan_crops_set_per_engine_match_transformers(gemma3):
    """Pan-and-scan for the engine: a wide image becomes the whole one and three crops, a tall one the whole and two,
    each its own 16 both-ways rows inside the text ``Gemma3Processor`` writes around them; 20-token chunks keep each
    crop whole."""
    images = [make_image(900, 300, seed=29), make_image(300, 700, seed=30)]  # seeds whose tokens the mask changes
    text = f"a {BOI} b {BOI}"
    async with AsyncEngine(gemma3, disable_log_stats=True, block_size=4, max_num_batched_tokens=20, max_num_seqs=4,
                           mm_processor_kwargs=PAN_AND_SCAN) as engine:
        out = await engine.generate({"prompt": text, "images": images}, GREEDY)
        soft = engine.tokenizer.convert_tokens_to_ids(SOFT)
    hf_prompt, hf_tokens = hf_gemma3_pan_and_scan_greedy(gemma3, text, images, 10)
    assert out.prompt_token_ids == hf_prompt and hf_prompt.count(soft) == 16 * (4 + 3)
    assert out.outputs[0].token_ids == hf_tokens
    assert hf_tokens != hf_gemma3_pan_and_scan_greedy(gemma3, text, images, 10, bidirectional=False)[1]


async def test_pan_and_scan_per_request_an_image_left_whole_and_the_processor_cache(gemma3):
    """Pan-and-scan asked by a request: its crops are keyed apart from the same image's plain item, a repeat finds the
    whole image and its crops in the processor cache; an image under the aspect ratio that starts cropping is left
    whole, as the plain path makes it. The pan-and-scan bounds are ``Gemma3Processor``'s."""
    from transformers import Gemma3Processor

    from asyncllm.models.gemma3_mm import Gemma3ForConditionalGeneration

    assert Gemma3ForConditionalGeneration.mm_processor_defaults.items() <= Gemma3Processor.images_kwargs.items()
    wide, square = make_image(900, 300, seed=23), make_image(300, 280, seed=24)
    text = f"see {BOI} here"
    cropped = {"prompt": text, "images": [wide], "mm_processor_kwargs": PAN_AND_SCAN}
    async with AsyncEngine(gemma3, disable_log_stats=True, block_size=4, max_num_seqs=4) as engine:
        plain = await engine.generate({"prompt": text, "images": [wide]}, GREEDY)
        hits = engine.stats().mm_cache_hits
        first = await engine.generate(cropped, GREEDY)
        assert engine.stats().mm_cache_hits == hits
        again = await engine.generate(cropped, GREEDY)
        assert engine.stats().mm_cache_hits == hits + 4  # the whole image and its three crops
        whole = await engine.generate({**cropped, "images": [square]}, GREEDY)
    assert (plain.prompt_token_ids, plain.outputs[0].token_ids) == hf_gemma3_greedy(gemma3, text, [wide], 10)
    expected = hf_gemma3_pan_and_scan_greedy(gemma3, text, [wide], 10)
    assert (first.prompt_token_ids, first.outputs[0].token_ids) == expected
    assert len(expected[0]) > len(plain.prompt_token_ids) + 3 * 16
    assert again.outputs[0].token_ids == expected[1]
    hf_whole = hf_gemma3_greedy(gemma3, text, [square], 10)
    assert (whole.prompt_token_ids, whole.outputs[0].token_ids) == hf_whole
    assert hf_gemma3_pan_and_scan_greedy(gemma3, text, [square], 10) == hf_whole
