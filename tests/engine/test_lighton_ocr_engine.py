"""LightOnOCR (Pixtral tower, Mistral 3's projector, Qwen3 decoder) end to end: prompts expanded as transformers'
``LightOnOcrProcessor`` expands them (image tokens alone, no breaks), greedy tokens equal transformers' for two images
whose 14-pixel patch grids have an odd side, split across prefill chunks beside a text-only request, from the prefix
cache, and in chat."""

from __future__ import annotations

import asyncio

import pytest
from lighton_ocr_utils import IMAGE, hf_lighton_ocr_greedy, make_tiny_lighton_ocr
from mm_utils import make_image

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def lighton_ocr(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_lighton_ocr(tmp_path_factory.mktemp("lighton_ocr"))


async def test_images_beside_text_from_the_prefix_cache_and_in_chat_match_transformers(lighton_ocr):
    """100 x 60 pixels -> 112 x 70 (8 x 5 patches: the merge drops the fifth row) -> 4 x 2 image tokens."""
    images = [make_image(100, 60, seed=1), make_image(50, 112, seed=2)]
    text = f"look {IMAGE} and {IMAGE} please"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image"]
    async with AsyncEngine(lighton_ocr, disable_log_stats=True, block_size=4, max_num_batched_tokens=8,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        again = await engine.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images[0]}},
                                                 {"type": "text", "text": "read it"}]}]
        stream = engine.chat(messages, GREEDY)
        chat_tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    hf_prompt, hf_tokens = hf_lighton_ocr_greedy(lighton_ocr, text, images, 8)
    image_id = engine.tokenizer.convert_tokens_to_ids(IMAGE)
    assert outs[0].prompt_token_ids == hf_prompt and hf_prompt.count(image_id) == 8 + 8
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_lighton_ocr_greedy(lighton_ocr, prompts[1], [],
                                                                                        8)[1]]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens
    chat_text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "read it"}]}], tokenize=False,
        add_generation_prompt=True)
    chat_prompt, expected = hf_lighton_ocr_greedy(lighton_ocr, chat_text, [images[0]], 8, add_special_tokens=False)
    assert stream.collector.prompt_token_ids == chat_prompt and chat_tokens == expected


@pytest.mark.parametrize("fields", [dict(pipeline_parallel_size=2),
                                    dict(tensor_parallel_size=2, mm_encoder_tp_mode="data")])
async def test_images_run_in_two_pipeline_stages_and_over_two_tensor_parallel_ranks(lighton_ocr, fields):
    """Two stages, one decoder layer each, the first encoding the images; two ranks splitting the decoder (the
    tower whole on each, "data" splitting a step's images): tokens equal transformers'."""
    images = [make_image(100, 60, seed=3)]
    text = f"{IMAGE} read it"
    async with AsyncEngine(lighton_ocr, disable_log_stats=True, block_size=4, max_model_len=128,
                           num_gpu_blocks_override=64, max_num_batched_tokens=8, **fields) as engine:
        outs = await asyncio.gather(engine.generate({"prompt": text, "images": images}, GREEDY),
                                    engine.generate("a text prompt beside it", GREEDY))
    assert outs[0].outputs[0].token_ids == hf_lighton_ocr_greedy(lighton_ocr, text, images, 8)[1]
    assert outs[1].outputs[0].token_ids == hf_lighton_ocr_greedy(lighton_ocr, "a text prompt beside it", [], 8)[1]
