"""Aya Vision end to end: each tile its own item between the processor's tile tokens (``<|START_OF_IMG|>``,
``TILE_i``, ``TILE_GLOBAL``, ``<|END_OF_IMG|>``), prompt ids and greedy tokens equal transformers'."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from aya_vision_utils import hf_aya_greedy, make_tiny_aya_vision
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_aya(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_aya_vision(tmp_path_factory.mktemp("aya_vision"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_aya: str):
    async with AsyncEngine(tiny_aya, disable_log_stats=True, block_size=4, max_num_batched_tokens=8,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


def patch_id(path: str) -> int:
    """``<|IMG_PATCH|>``'s id."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).image_token_id)


@pytest.mark.parametrize("size, tiles", [((40, 40), 1), ((150, 60), 4)])
async def test_image_matches_transformers_beside_a_text_prompt(engine, tiny_aya, size, tiles):
    """One tile alone, and 3 x 1 tiles plus the thumbnail, split across 8-token chunks, batched with a text-only
    prompt: prompt ids and greedy tokens equal transformers'."""
    image = make_image(*size, seed=sum(size))
    text = "Describe <image> please"
    out, plain = await asyncio.gather(engine.generate({"prompt": text, "images": [image]}, GREEDY),
                                      engine.generate("A text-only prompt, long enough for chunks", GREEDY))
    hf_prompt, hf_tokens = hf_aya_greedy(tiny_aya, text, [image], 8)
    assert out.prompt_token_ids == hf_prompt
    assert out.outputs[0].token_ids == hf_tokens
    assert hf_prompt.count(patch_id(tiny_aya)) == 4 * tiles
    assert plain.outputs[0].token_ids == hf_aya_greedy(tiny_aya, "A text-only prompt, long enough for chunks", [],
                                                       8)[1]


async def test_two_images_and_a_repeat_from_the_caches(engine, tiny_aya):
    """Two tiled images in one prompt, then the same prompt again: its tiles cross as keys, its prefix is cached."""
    images = [make_image(150, 60, seed=7), make_image(60, 130, seed=8)]
    prompt = {"prompt": "<image> and <image>", "images": images}
    first = await engine.generate(prompt, GREEDY)
    expected = hf_aya_greedy(tiny_aya, "<image> and <image>", images, 8)
    assert (first.prompt_token_ids, first.outputs[0].token_ids) == expected
    again = await engine.generate(prompt, GREEDY)
    assert again.outputs[0].token_ids == expected[1]
    assert again.num_cached_tokens > 0


async def test_chat_message_with_an_image_part(engine, tiny_aya):
    """A chat image part through the checkpoint's template: the same prompt and tokens as transformers'."""
    image = make_image(120, 50, seed=5)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "What is it?"}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    hf_prompt, hf_tokens = hf_aya_greedy(tiny_aya, None, [image], 8, messages=hf_messages)
    assert stream.collector.prompt_token_ids == hf_prompt
    assert tokens == hf_tokens


async def test_a_tokenizer_that_splits_the_image_marker_gets_it_as_one_token(tiny_aya):
    """``<image>`` is read from the tokenizer; one that splits it (transformers' processor replaces the text, so a
    checkpoint's tokenizer need not hold it) gets it added as a special token, past its vocabulary, other text
    tokenized as before."""
    from transformers import AutoConfig, AutoTokenizer

    from asyncllm.models.aya_vision import AyaVisionForConditionalGeneration
    from asyncllm.tiny import tiny_checkpoint

    config = AutoConfig.from_pretrained(tiny_aya)
    marker = AyaVisionForConditionalGeneration.mm_placeholder_token_of(config, AutoTokenizer.from_pretrained(tiny_aya))
    assert marker == AutoTokenizer.from_pretrained(tiny_aya).convert_tokens_to_ids("<image>") != config.image_token_id
    splitting = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    size, text = len(splitting), "a plain <|user|> text"
    before = splitting.encode(text, add_special_tokens=False)
    assert len(splitting.encode("<image>", add_special_tokens=False)) > 1
    added = AyaVisionForConditionalGeneration.mm_placeholder_token_of(config, splitting)
    assert added == size and splitting.encode("x <image> y", add_special_tokens=False).count(added) == 1
    assert splitting.encode(text, add_special_tokens=False) == before


@pytest.mark.parametrize("mode", ["weights", "data"])
async def test_tensor_parallel_with_the_tower_whole_on_each_rank(tiny_aya, mode):
    """Two ranks: the decoder sharded, the tower whole on both ("data" deals the tiles out); transformers' tokens."""
    image = make_image(150, 60, seed=21)
    async with AsyncEngine(tiny_aya, disable_log_stats=True, tensor_parallel_size=2, mm_encoder_tp_mode=mode,
                           max_num_batched_tokens=16) as engine:
        out = await engine.generate({"prompt": "Describe <image> please", "images": [image]}, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_aya_greedy(tiny_aya, "Describe <image> please",
                                                                             [image], 8)
