"""Llama 3.2 Vision end to end, tensor-parallel over 2 ranks (each keeps half the heads of every attention, the
cross-attention's too, and the whole vision encoder): greedy tokens equal transformers' for one image, several images
(a run of adjacent ones among them), text before the first image and text-only prompts, whatever the batch, the
prefill chunks (8 tokens a step), preemptions (16 KV blocks) and the prefix cache's hits; prompts that differ only in
their images never share cached blocks; a prompt with more images than limit_mm_per_prompt is refused; a LoRA
adapter's tokens with an image equal PEFT's."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from mllama_utils import hf_mllama_greedy, make_tiny_mllama
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.lora import LoRARequest

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
IMAGE_ID = 512
"""``<|image|>``: the first id past the tiny tokenizer's 512."""
PADDING = " filler words to fill a few blocks of the cache" * 2
"""Text before the image, so several full blocks of the prompt come before it (prefix-cache keys)."""


@pytest.fixture(scope="module")
def tiny_mllama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_mllama(tmp_path_factory.mktemp("mllama"))


@pytest.fixture(scope="module")
def adapter(tiny_mllama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PEFT adapter on the decoder's self-attention and MLPs (the cross-attention layers' MLPs among them)."""
    from lora_utils import make_adapter
    from transformers import MllamaForConditionalGeneration

    return make_adapter(tiny_mllama, str(tmp_path_factory.mktemp("mllama_adapter")), seed=7, rank=4, alpha=8,
                        targets=r"model\.language_model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj",
                        auto_class=MllamaForConditionalGeneration)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_mllama: str):
    async with AsyncEngine(tiny_mllama, disable_log_stats=True, block_size=4, max_num_batched_tokens=8,
                           max_num_seqs=4, enable_prefix_caching=True, num_gpu_blocks_override=16,
                           max_model_len=64, tensor_parallel_size=2, limit_mm_per_prompt={"image": 3},
                           enable_lora=True, max_lora_rank=8) as engine:
        yield engine


def _prompts() -> list:
    wide, tall, square = make_image(40, 20, seed=1), make_image(20, 50, seed=2), make_image(30, 30, seed=3)
    return [
        {"prompt": "Describe <|image|> briefly", "images": [wide]},
        {"prompt": "<|image|><|image|> compare them and then <|image|> the end", "images": [wide, tall, square]},
        {"prompt": "one <|image|> two <|image|> three", "images": [tall, square]},
        "A text prompt with no image",
    ]


async def test_prompts_batched_together_match_transformers(engine, tiny_mllama):
    """All at once (the text-only one among them, each prefill chunked over several steps, some requests
    preempted and recomputed: their cross-attention states computed again in the row they resume in): each prompt's
    tokens equal transformers' for it alone, with the cross-attention mask its processor writes."""
    prompts = _prompts()
    preemptions = engine.stats().num_preemptions_total
    longer = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(prompt, longer) for prompt in prompts))
    assert engine.stats().num_preemptions_total > preemptions  # 16 blocks: some are recomputed, images and all
    assert [out.prompt_token_ids.count(IMAGE_ID) for out in outs] == [1, 3, 2, 0]
    for prompt, out in zip(prompts, outs):
        images = prompt["images"] if isinstance(prompt, dict) else []
        assert out.outputs[0].token_ids == hf_mllama_greedy(tiny_mllama, out.prompt_token_ids, images, 16), prompt


async def test_prefix_cache_hits_only_prompts_with_the_same_images(engine, tiny_mllama):
    """Alone, the prompt matches transformers; a repeat hits the cached blocks (text before the image included)
    and gives the same tokens; the same text with another image hits none of them (the text before the image
    attends to the images too) and matches transformers for its own image."""
    first, other = make_image(24, 40, seed=7), make_image(24, 40, seed=8)
    text = "Look" + PADDING + " <|image|> now"
    before = engine.stats()
    out = await engine.generate({"prompt": text, "images": [first]}, GREEDY)
    after_first = engine.stats()
    again = await engine.generate({"prompt": text, "images": [first]}, GREEDY)
    after_again = engine.stats()
    swapped = await engine.generate({"prompt": text, "images": [other]}, GREEDY)
    after_swapped = engine.stats()
    assert after_first.prefix_cache_hits == before.prefix_cache_hits
    assert after_again.prefix_cache_hits - after_first.prefix_cache_hits >= len(out.prompt_token_ids) - 4
    assert after_swapped.prefix_cache_hits == after_again.prefix_cache_hits
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert swapped.outputs[0].token_ids == hf_mllama_greedy(tiny_mllama, swapped.prompt_token_ids, [other], 6)
    assert out.outputs[0].token_ids == hf_mllama_greedy(tiny_mllama, out.prompt_token_ids, [first], 6)


async def test_more_images_than_the_limit_are_refused(engine):
    """limit_mm_per_prompt={"image": 3}: the KV budget keeps room for 3 images' cross-attention states a seat (1
    when unset), so a fourth image is refused before it is read."""
    image = make_image(20, 20, seed=4)
    with pytest.raises(InvalidRequestError, match=r"4 images, over limit_mm_per_prompt\['image'\]=3"):
        await engine.generate({"prompt": "<|image|>" * 4, "images": [image] * 4}, GREEDY)


async def test_an_image_the_vision_tower_refuses_fails_alone(engine, tiny_mllama):
    """A host process sharing the core that sends an image of the wrong size: that request fails (its rows get no
    cross-attention states), and the engine serves the next image request transformers' tokens."""
    import msgspec
    from mm_utils import items_altered

    bad = {"data": bytes(4 * 11), "shape": [11]}  # an aspect ratio id and 10 values: no whole tile
    with items_altered(engine, lambda item: msgspec.structs.replace(item, **bad)):
        with pytest.raises(InvalidRequestError, match=r"mm_items\[1\]: the encoder refused its data of shape \[11\]"):
            await engine.generate({"prompt": "<|image|> what", "images": [make_image(20, 20, 5)]}, GREEDY)
    image = make_image(30, 20, seed=6)
    good = await engine.generate({"prompt": "<|image|> and", "images": [image]}, GREEDY)
    assert good.outputs[0].token_ids == hf_mllama_greedy(tiny_mllama, good.prompt_token_ids, [image], 6)


async def test_an_adapter_with_an_image_matches_peft(engine, tiny_mllama, adapter):
    """Beside the same prompt on the base model: the adapter's greedy tokens equal PEFT's on transformers' class with
    the image (its cross-attention layers' MLPs adapted too), the base model's transformers'."""
    prompt = {"prompt": "Describe <|image|> briefly", "images": [make_image(40, 20, seed=1)]}
    longer = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    adapted, base = await asyncio.gather(engine.generate(prompt, longer, lora_request=LoRARequest("a", 1, adapter)),
                                         engine.generate(prompt, longer))
    ids, images = adapted.prompt_token_ids, prompt["images"]
    assert adapted.outputs[0].token_ids == hf_mllama_greedy(tiny_mllama, ids, images, 8, adapter)
    assert base.outputs[0].token_ids == hf_mllama_greedy(tiny_mllama, ids, images, 8)
    assert adapted.outputs[0].token_ids != base.outputs[0].token_ids
