"""LFM2-VL end to end: each tile its own item between the processor's markers (``<|image_start|>``,
``<|img_row_R_col_C|>``, ``<|img_thumbnail|>``, ``<|image_end|>``) over the LFM2 hybrid decoder; prompt ids and greedy
tokens equal transformers' with images split across prefill chunks, batched, from the prefix cache (the conv
layers' saved states), in chat, on two tensor-parallel ranks, in two pipeline stages and with LoRA adapters."""

from __future__ import annotations

import asyncio
import functools

import pytest
import pytest_asyncio
from engine_helpers import (
    assert_chat_image_part_equals_transformers, assert_image_prompt_equals_transformers,
    assert_images_equal_transformers_then_hit_the_cache,
)
from lfm2_vl_utils import hf_lfm2_vl_greedy, make_tiny_lfm2_vl
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8
"""max_num_batched_tokens: fewer than every tile's placeholders, so each tile is split across steps."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_lfm2_vl(tmp_path_factory.mktemp("lfm2_vl"), layers=4)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny: str):
    """One engine, adapters enabled, shared by the image tests and the two LoRA tests below."""
    async with AsyncEngine(tiny, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True, mamba_block_size=8,
                           mamba_checkpoint_slots=8, enable_lora=True) as engine:  # conv states saved every 8 tokens
        yield engine


def image_id(path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).image_token_id)


@pytest.mark.parametrize("size, tokens", [((70, 50), 12), ((150, 60), 3 * 16 + 12)])
async def test_image_matches_transformers_beside_a_text_prompt(engine, tiny, size, tokens):
    """One tile alone (3 x 4 tokens), and 3 x 1 tiles plus a thumbnail, split across 8-token chunks, batched with a
    text-only prompt: prompt ids and greedy tokens equal transformers'."""
    image = make_image(*size, seed=sum(size))
    text = "Describe <image> please"
    out, plain = await asyncio.gather(engine.generate({"prompt": text, "images": [image]}, GREEDY),
                                      engine.generate("A text-only prompt, long enough for chunks", GREEDY))
    hf_prompt, hf_tokens = hf_lfm2_vl_greedy(tiny, text, [image], 8)
    assert out.prompt_token_ids == hf_prompt
    assert out.outputs[0].token_ids == hf_tokens
    assert hf_prompt.count(image_id(tiny)) == tokens
    assert plain.outputs[0].token_ids == hf_lfm2_vl_greedy(tiny, "A text-only prompt, long enough for chunks", [],
                                                           8)[1]


async def test_two_images_and_a_repeat_from_the_caches(engine, tiny):
    """Two images of different sizes (one split) in one prompt, then the same prompt again: its tiles cross as keys,
    its prefix (the conv states saved with it) comes from the cache, the tokens are transformers'."""
    images = [make_image(150, 60, seed=7), make_image(33, 97, seed=8)]
    await assert_images_equal_transformers_then_hit_the_cache(engine, "<image> and <image> compared", images,
                                                              functools.partial(hf_lfm2_vl_greedy, tiny))


async def test_chat_message_with_an_image_part(engine, tiny):
    await assert_chat_image_part_equals_transformers(engine, make_image(120, 50, seed=5),
                                                     functools.partial(hf_lfm2_vl_greedy, tiny))


@pytest.mark.parametrize("mode", ["weights", "data"])
async def test_tensor_parallel_with_the_tower_whole_on_each_rank(tiny, mode):
    """Two ranks: the decoder sharded, the tower whole on both ("data" deals the tiles out); transformers' tokens."""
    await assert_image_prompt_equals_transformers(tiny, "Describe <image> please", [make_image(150, 60, seed=21)],
                                                  functools.partial(hf_lfm2_vl_greedy, tiny), tensor_parallel_size=2,
                                                  mm_encoder_tp_mode=mode, max_num_batched_tokens=16)


async def test_two_pipeline_stages_match_transformers(tiny):
    """The tower on the first stage, a conv and an attention layer on each."""
    await assert_image_prompt_equals_transformers(tiny, "<image> and the end", [make_image(150, 60, seed=2)],
                                                  functools.partial(hf_lfm2_vl_greedy, tiny),
                                                  pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=BUDGET)


async def test_lora_adapters_on_the_decoder_equal_peft(engine, tiny, tmp_path):
    """PEFT's adapter of the decoder's attention and MLPs (LFM2's ``out_proj``, ``feed_forward.w1`` / ``w3`` /
    ``w2``; its conv layers take none), with an image, batched with the base model: PEFT's tokens and
    transformers'."""
    from lfm2_vl_utils import lfm2_vl_adapter

    from asyncllm import LoRARequest

    adapter = lfm2_vl_adapter(tiny, str(tmp_path / "adapter"))
    images, text = [make_image(150, 60, seed=2)], "<image> and the end"
    prompt = {"prompt": text, "images": images}
    adapted, base = await asyncio.gather(
        engine.generate(prompt, GREEDY, lora_request=LoRARequest("lfm", 1, adapter)),
        engine.generate(prompt, GREEDY))
    assert adapted.outputs[0].token_ids == hf_lfm2_vl_greedy(tiny, text, images, 8, adapter=adapter)[1]
    assert base.outputs[0].token_ids == hf_lfm2_vl_greedy(tiny, text, images, 8)[1] != adapted.outputs[0].token_ids


async def test_an_adapter_of_the_tower_is_refused(engine, tiny, tmp_path):
    """The tower takes no adapters: one that adapts its projections beside the decoder's is refused, naming them
    (not run without them)."""
    from lfm2_vl_utils import lfm2_vl_adapter

    from asyncllm import LoRARequest
    from asyncllm.errors import InvalidRequestError

    adapter = lfm2_vl_adapter(tiny, str(tmp_path / "tower"), targets=r".*(vision_tower|language_model).*\.q_proj")
    with pytest.raises(InvalidRequestError, match="vision_tower.*not built"):  # id 2: the other test's holds 1
        await engine.generate("a text", GREEDY, lora_request=LoRARequest("tower", 2, adapter))
