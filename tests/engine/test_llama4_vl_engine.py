"""Llama 4 with images end to end: each tile its own item between the processor's separators (``<|image_start|>``,
``<|tile_x_separator|>``, ``<|tile_y_separator|>``, ``<|image|>`` before the global view, ``<|image_end|>``) over the
Llama 4 decoder (chunked attention, experts); prompt ids and greedy tokens equal transformers' with images split
across prefill chunks, batched, from the prefix cache, in chat, on two tensor-parallel ranks, in two pipeline stages
and with LoRA adapters on the decoder."""

from __future__ import annotations

import asyncio
import functools

import pytest
import pytest_asyncio
from engine_helpers import (
    assert_chat_image_part_equals_transformers, assert_image_prompt_equals_transformers,
    assert_images_equal_transformers_then_hit_the_cache,
)
from llama4_vl_utils import hf_llama4_greedy, make_tiny_llama4_vl
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8
"""max_num_batched_tokens: half a tile's 16 rows, so each tile is split across steps."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama4_vl(tmp_path_factory.mktemp("llama4_vl"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny: str):
    """One engine, adapters enabled, shared by the image tests and the two LoRA tests below."""
    async with AsyncEngine(tiny, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True, enable_lora=True) as engine:
        yield engine


def patch_id(path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).image_token_id)


@pytest.mark.parametrize("size, tiles", [((30, 28), 1), ((70, 50), 5)])
async def test_image_matches_transformers_beside_a_text_prompt(engine, tiny, size, tiles):
    """One tile alone, and 2 x 2 tiles plus the global view, split across 8-token chunks, batched with a text-only
    prompt: prompt ids and greedy tokens equal transformers'."""
    image = make_image(*size, seed=sum(size))
    text = "Describe <|image|> please"
    plain_text = "A text-only prompt, long enough for chunks"
    out, plain = await asyncio.gather(engine.generate({"prompt": text, "images": [image]}, GREEDY),
                                      engine.generate(plain_text, GREEDY))
    hf_prompt, hf_tokens = hf_llama4_greedy(tiny, text, [image], 8)
    assert out.prompt_token_ids == hf_prompt
    assert out.outputs[0].token_ids == hf_tokens
    assert hf_prompt.count(patch_id(tiny)) == 16 * tiles
    assert plain.outputs[0].token_ids == hf_llama4_greedy(tiny, plain_text, [], 8)[1]


async def test_two_images_and_a_repeat_from_the_caches(engine, tiny):
    """Two images (one tiled 4 x 1, one a tile alone) in one prompt, then the same prompt again: its prefix comes
    from the cache, the tokens are transformers'."""
    images = [make_image(150, 40, seed=7), make_image(33, 30, seed=8)]
    await assert_images_equal_transformers_then_hit_the_cache(engine, "<|image|> and <|image|> compared", images,
                                                              functools.partial(hf_llama4_greedy, tiny))


async def test_chat_message_with_an_image_part(engine, tiny):
    await assert_chat_image_part_equals_transformers(engine, make_image(70, 50, seed=5),
                                                     functools.partial(hf_llama4_greedy, tiny))


@pytest.mark.parametrize("mode", ["weights", "data"])
async def test_tensor_parallel_with_the_tower_whole_on_each_rank(tiny, mode):
    """Two ranks: the decoder (and its experts) sharded, the tower whole on both ("data" deals the tiles out)."""
    await assert_image_prompt_equals_transformers(tiny, "Describe <|image|> please", [make_image(70, 50, seed=21)],
                                                  functools.partial(hf_llama4_greedy, tiny), tensor_parallel_size=2,
                                                  mm_encoder_tp_mode=mode, max_num_batched_tokens=16)


async def test_two_pipeline_stages_match_transformers(tiny):
    """The tower on the first stage, one decoder layer on each."""
    await assert_image_prompt_equals_transformers(tiny, "<|image|> and the end", [make_image(70, 50, seed=2)],
                                                  functools.partial(hf_llama4_greedy, tiny),
                                                  pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=BUDGET)


async def test_lora_adapters_on_the_decoder_equal_peft(engine, tiny, tmp_path):
    """PEFT's adapter of the decoder's attention, dense MLP, shared expert and routed experts, with an image, batched
    with the base model: PEFT's tokens and transformers'."""
    from lora_utils import make_adapter
    from transformers import Llama4ForConditionalGeneration

    from asyncllm import LoRARequest

    adapter = make_adapter(tiny, str(tmp_path / "adapter"), seed=3, rank=4, alpha=8,
                           auto_class=Llama4ForConditionalGeneration,
                           targets=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
                           target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"])
    images, text = [make_image(70, 50, seed=2)], "<|image|> and the end"
    prompt = {"prompt": text, "images": images}
    adapted, base = await asyncio.gather(
        engine.generate(prompt, GREEDY, lora_request=LoRARequest("l4", 1, adapter)),
        engine.generate(prompt, GREEDY))
    assert adapted.outputs[0].token_ids == hf_llama4_greedy(tiny, text, images, 8, adapter=adapter)[1]
    assert base.outputs[0].token_ids == hf_llama4_greedy(tiny, text, images, 8)[1] != adapted.outputs[0].token_ids


async def test_an_adapter_of_the_tower_is_refused(engine, tiny, tmp_path):
    """The vision model takes no adapters: one that adapts its projections beside the decoder's is refused, naming
    them (not run without them)."""
    from lora_utils import make_adapter
    from transformers import Llama4ForConditionalGeneration

    from asyncllm import LoRARequest
    from asyncllm.errors import InvalidRequestError

    adapter = make_adapter(tiny, str(tmp_path / "tower"), seed=3, rank=4, alpha=8, targets=["q_proj"],
                           auto_class=Llama4ForConditionalGeneration)
    with pytest.raises(InvalidRequestError, match="vision_model.*not built"):  # id 2: the other test's holds 1
        await engine.generate("a text", GREEDY, lora_request=LoRARequest("tower", 2, adapter))


async def test_text_only_mode_serves_the_language_model(tiny):
    """``limit_mm_per_prompt`` of 0 images: the language model alone (the vision model unread), transformers'
    tokens."""
    async with AsyncEngine(tiny, disable_log_stats=True, limit_mm_per_prompt={"image": 0}) as engine:
        out = await engine.generate("A text-only prompt", GREEDY)
    assert out.outputs[0].token_ids == hf_llama4_greedy(tiny, "A text-only prompt", [], 8)[1]
