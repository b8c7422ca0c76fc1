"""Mistral 3 (Pixtral tower) end to end: images whose rows of ``[IMG]`` are closed by ``[IMG_BREAK]`` / ``[IMG_END]``
tokens that keep their own embeddings, token for token equal to transformers with images split across prefill
chunks, beside text-only requests, from the prefix cache, in chat, and under Ministral 3's decoder; served as text
alone with a LoRA adapter on its language model."""

from __future__ import annotations

import asyncio

import pytest
from lora_utils import make_adapter, peft_greedy
from mistral3_utils import IMAGE, hf_mistral3_greedy, make_tiny_mistral3
from mm_utils import make_image

from asyncllm import AsyncEngine, LoRARequest, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_mistral3(tmp_path_factory.mktemp("mistral3"))


async def test_images_of_two_sizes_beside_text_and_from_the_prefix_cache_match_transformers(mistral3):
    images = [make_image(100, 60, seed=1), make_image(50, 112, seed=2)]
    text = f"look {IMAGE} and {IMAGE} please"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image"]
    async with AsyncEngine(mistral3, disable_log_stats=True, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                           enable_prefix_caching=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        again = await engine.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images[1]}},
                                                 {"type": "text", "text": "what is it?"}]}]
        stream = engine.chat(messages, GREEDY)
        chat_tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    hf_prompt, hf_tokens = hf_mistral3_greedy(mistral3, text, images, 8)
    breaks = [engine.tokenizer.convert_tokens_to_ids(t) for t in ("[IMG_BREAK]", "[IMG_END]")]
    assert outs[0].prompt_token_ids == hf_prompt and sum(hf_prompt.count(t) for t in breaks) == 3 + 4
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_mistral3_greedy(mistral3, prompts[1], [], 8)[1]]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens
    chat_text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}], tokenize=False)
    chat_prompt, expected = hf_mistral3_greedy(mistral3, chat_text, [images[1]], 8, add_special_tokens=False)
    assert stream.collector.prompt_token_ids == chat_prompt and chat_tokens == expected


@pytest.mark.parametrize("decoder", ["ministral3", "mistral4"])
async def test_ministral3_under_the_tower_matches_transformers(tmp_path_factory, decoder):
    """Ministral 3's decoder (YaRN, the attention temperature past position 16) under the tower; Mistral 4's (the
    latent attention and experts with the same temperature)."""
    ministral3 = make_tiny_mistral3(tmp_path_factory.mktemp(decoder), decoder=decoder)
    images = [make_image(112, 112, seed=3), make_image(30, 40, seed=4)]
    texts = [f"{IMAGE} one", f"and {IMAGE} two"]
    async with AsyncEngine(ministral3, disable_log_stats=True, block_size=4, max_num_batched_tokens=16,
                           max_num_seqs=2) as engine:
        outs = await asyncio.gather(*(engine.generate({"prompt": t, "images": [i]}, GREEDY)
                                      for t, i in zip(texts, images)))
    assert [o.outputs[0].token_ids for o in outs] == [hf_mistral3_greedy(ministral3, t, [i], 8)[1]
                                                       for t, i in zip(texts, images)]
    assert len(outs[0].prompt_token_ids) > 16


async def test_pixtral_12b_llava_checkpoint_matches_transformers(tmp_path_factory):
    """Pixtral-12B's HF layout: a LLaVA checkpoint with a Pixtral tower (no patch merging: a token per 14-pixel
    patch here) and LLaVA's projector; its rows and breaks as Mistral 3's; a text prompt beside them."""
    from asyncllm.models.mistral3 import PixtralLlavaForConditionalGeneration
    from asyncllm.models.registry import get_model_class
    from asyncllm.models.checkpoint import load_hf_config
    from mistral3_utils import make_tiny_pixtral_llava

    path = make_tiny_pixtral_llava(tmp_path_factory.mktemp("pixtral"))
    assert get_model_class(load_hf_config(path)) is PixtralLlavaForConditionalGeneration
    images = [[make_image(60, 40, seed=5)], [make_image(30, 30, seed=6)], []]
    texts = [f"{IMAGE} one", f"and {IMAGE} two", "no image"]
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=16,
                           max_num_seqs=3) as engine:
        outs = await asyncio.gather(*(engine.generate({"prompt": t, "images": i}, GREEDY)
                                      for t, i in zip(texts, images)))
    expected = [hf_mistral3_greedy(path, t, i, 8, unit=14) for t, i in zip(texts, images)]
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == expected


async def test_served_as_text_with_a_lora_adapter_on_its_language_model(mistral3, tmp_path):
    """``limit_mm_per_prompt={"image": 0}``: the language model alone (the tower unread), adapters on it (PEFT's
    names under ``model.language_model.``): transformers' and PEFT's greedy tokens."""
    from transformers import AutoModelForImageTextToText

    adapter = make_adapter(mistral3, str(tmp_path / "adapter"), seed=1, rank=4, alpha=8,
                           targets=["q_proj", "v_proj", "o_proj"], auto_class=AutoModelForImageTextToText)
    prompt = "[INST]what is paged attention?[/INST]"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(mistral3, enable_lora=True, limit_mm_per_prompt={"image": 0},
                           disable_log_stats=True) as engine:
        base, adapted = await asyncio.gather(engine.generate(prompt, params),
                                             engine.generate(prompt, params, lora_request=LoRARequest("a", 1, adapter)))
    prompt_ids, expected = hf_mistral3_greedy(mistral3, prompt, [], 8)
    assert base.token_ids == expected
    assert adapted.token_ids == peft_greedy(mistral3, adapter, prompt_ids, 8, auto_class=AutoModelForImageTextToText)
    assert adapted.token_ids != base.token_ids
