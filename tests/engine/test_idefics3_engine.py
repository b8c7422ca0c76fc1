"""Idefics3 / SmolVLM end to end: each tile its own item between the processor's text tokens (row and column
markers, newlines, the whole image's tag), greedy tokens and prompts equal transformers'."""

from __future__ import annotations

import pytest
import pytest_asyncio
from mm_utils import hf_llava_greedy, make_image, make_tiny_idefics3

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_idefics3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_idefics3: str):
    async with AsyncEngine(tiny_idefics3, disable_log_stats=True, block_size=4, max_num_batched_tokens=8,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


@pytest.mark.parametrize("size", [(100, 40), (40, 100), (30, 30)])
async def test_one_image_matches_transformers(engine, tiny_idefics3, size):
    """A 1 x 2 and a 2 x 1 grid, and a small image upscaled to 2 x 2: every tile and the whole image, the text
    between them; 8-token chunks split the runs."""
    image = make_image(*size, seed=sum(size))
    out = await engine.generate({"prompt": "Describe <image> please", "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_idefics3, "Describe <image> please", [image], 8)
    assert out.prompt_token_ids == hf_prompt
    assert out.outputs[0].token_ids == hf_tokens


async def test_two_images_and_a_repeat_from_the_caches(engine, tiny_idefics3):
    """Two images in one prompt, then the same prompt again: its tiles cross as keys, its prefix is cached."""
    images = [make_image(100, 40, seed=7), make_image(40, 100, seed=8)]
    prompt = {"prompt": "<image> and <image>", "images": images}
    first = await engine.generate(prompt, GREEDY)
    expected = hf_llava_greedy(tiny_idefics3, "<image> and <image>", images, 8)
    assert (first.prompt_token_ids, first.outputs[0].token_ids) == expected
    hits = engine.stats().mm_cache_hits
    again = await engine.generate(prompt, GREEDY)
    assert again.outputs[0].token_ids == expected[1]
    assert again.num_cached_tokens > 0
    assert engine.stats().mm_cache_hits == hits + 6  # two images of two tiles and a whole one each


async def test_smolvlm_matches_transformers(tmp_path):
    """SmolVLM: Idefics3's model under its own names; the prompt is SmolVLM's processor's text (its own function,
    tokenized), the tokens transformers' greedy ones for the same pixels."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from mm_utils import make_tiny_smolvlm

    path = make_tiny_smolvlm(tmp_path / "smolvlm")
    image = make_image(100, 40, seed=3)
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=8) as engine:
        out = await engine.generate({"prompt": "Describe <image> please", "images": [image]}, GREEDY)
    tokenizer, processor = AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    pixels = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt",
                       return_row_col_info=True)
    text = get_image_prompt_string(pixels["rows"][0][0], pixels["cols"][0][0], 4, "<fake_token_around_image>",
                                   "<image>", "<global-img>")
    assert out.prompt_token_ids == tokenizer(f"Describe {text} please")["input_ids"]
    model = SmolVLMForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(input_ids=torch.tensor([out.prompt_token_ids]), pixel_values=pixels["pixel_values"],
                            pixel_attention_mask=pixels["pixel_attention_mask"], max_new_tokens=8, do_sample=False)
    assert out.outputs[0].token_ids == hf[0, len(out.prompt_token_ids):].tolist()


async def test_a_repeated_image_is_not_processed_again_while_its_tiles_are_cached(tiny_idefics3, monkeypatch):
    """The host keeps each tiled image's layout: the same image again costs no decoding or processing while the
    core holds its tiles; once they are forgotten it is processed again, to the same prompt."""
    from transformers import AutoConfig, AutoTokenizer

    from asyncllm.mm.inputs import MultiModalInputs
    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.idefics3 import Idefics3ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tiny_idefics3)
    mm = MultiModalProcessor(tiny_idefics3, AutoConfig.from_pretrained(tiny_idefics3), Idefics3ForConditionalGeneration,
                             tokenizer, 2**26, 2**24)
    calls = []
    real = mm._processor_output
    monkeypatch.setattr(mm, "_processor_output", lambda *a: calls.append(1) or real(*a))
    ids = tokenizer("Describe <image> please", add_special_tokens=False)["input_ids"]
    image = MultiModalInputs([make_image(100, 40, seed=11)])
    first = mm.process(ids, image, "prompt.images")
    again = mm.process(ids, image, "prompt.images")
    assert len(calls) == 1 and again.token_ids == first.token_ids
    assert [item.data for item in again.items] == [None] * 3 and [item.data is not None for item in first.items] == [True] * 3
    mm.forget([item.mm_hash for item in first.items])
    third = mm.process(ids, image, "prompt.images")
    assert len(calls) == 2 and third.token_ids == first.token_ids
