"""LLaVA-NeXT end to end: anyres tiles of every grid shape, unpadded by the original size, with the newline
embeddings; greedy tokens and prompts equal transformers', the images split across prefill chunks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
from mm_utils import hf_llava_greedy, make_image, make_tiny_llava_next

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.models.checkpoint import load_hf_config
from asyncllm.models.llava_next import LlavaNextForConditionalGeneration

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_llava_next(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava_next(tmp_path_factory.mktemp("llava_next"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llava_next: str):
    async with AsyncEngine(tiny_llava_next, disable_log_stats=True, block_size=4, max_num_batched_tokens=24,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


@pytest.mark.parametrize("size", [(100, 40), (40, 100), (90, 90), (150, 50), (57, 55)])
async def test_one_image_of_each_grid_matches_transformers(engine, tiny_llava_next, size):
    """Wide (1x2), tall (2x1), square (2x2), very wide (1x3) and nearly square: each grid, padding cut top and
    bottom or left and right."""
    image = make_image(*size, seed=sum(size))
    out = await engine.generate({"prompt": "Describe <image> please", "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_llava_next, "Describe <image> please", [image], 8)
    assert out.prompt_token_ids == hf_prompt
    assert out.outputs[0].token_ids == hf_tokens


async def test_images_of_different_sizes_in_one_prompt_and_batched(engine, tiny_llava_next):
    """Three images in one prompt, and two requests at once whose tiles have one shape but whose lengths differ."""
    images = [make_image(100, 40, seed=1), make_image(40, 100, seed=2), make_image(100, 45, seed=3)]
    text = "<image> then <image> and <image> end"
    out = await engine.generate({"prompt": text, "images": images}, GREEDY)
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_llava_next, text, images, 8)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (hf_prompt, hf_tokens)
    pair = [make_image(100, 40, seed=4), make_image(100, 30, seed=5)]  # both 1x2 grids, unpadded differently
    outs = await asyncio.gather(*(engine.generate({"prompt": "A <image>", "images": [im]}, GREEDY) for im in pair))
    for image, got in zip(pair, outs):
        assert got.outputs[0].token_ids == hf_llava_greedy(tiny_llava_next, "A <image>", [image], 8)[1]
    assert len(outs[0].prompt_token_ids) != len(outs[1].prompt_token_ids)


def test_the_placeholder_length_follows_the_original_size(tiny_llava_next):
    """16 base features, then the unpadded grid rows each with its newline (transformers' processor agrees)."""
    hf_config = load_hf_config(tiny_llava_next)
    tiles = np.zeros((4, 3, 56, 56), dtype=np.float32)  # base + a 1x2 grid + the size tile
    tiles[-1].reshape(-1)[:2] = (30, 100)  # 100 wide, 30 high: the 4x8 grid keeps its middle 2 rows
    assert LlavaNextForConditionalGeneration.mm_placeholder_length_of(hf_config, tiles) == 16 + 2 * (8 + 1)
    tiles[-1].reshape(-1)[:2] = (55, 57)  # nearly square in a 1x2 grid: its middle 4 columns
    assert LlavaNextForConditionalGeneration.mm_placeholder_length_of(hf_config, tiles) == 16 + 4 * (4 + 1)


def test_one_batch_of_equal_tile_shapes_gives_each_image_its_own_features(tiny_llava_next):
    """Two images whose tiles share a shape (so the worker encodes them in one call) but whose unpadded grids
    differ: each image's features equal transformers' ``get_image_features``."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoProcessor
    from transformers import LlavaNextForConditionalGeneration as HFLlavaNext

    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import load_model

    processor = AutoProcessor.from_pretrained(tiny_llava_next).image_processor
    images = [Image.open(io.BytesIO(make_image(100, h, seed=h))).convert("RGB") for h in (40, 30)]
    processed = [processor(images=[image], return_tensors="np") for image in images]
    pixels = torch.stack([torch.from_numpy(LlavaNextForConditionalGeneration.mm_pixel_values(p)) for p in processed])
    hf_config = load_hf_config(tiny_llava_next)
    ours = load_model(EngineConfig.create(tiny_llava_next), hf_config, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        got = ours.embed_multimodal(pixels)
        hf = HFLlavaNext.from_pretrained(tiny_llava_next, dtype=torch.float32).eval()
        both = processor(images=images, return_tensors="pt")
        expected = hf.model.get_image_features(both["pixel_values"], both["image_sizes"]).pooler_output
    assert [rows.shape[0] for rows in got] == [16 + 4 * 9, 16 + 2 * 9]
    for rows, want in zip(got, expected):
        torch.testing.assert_close(rows, want, atol=1e-5, rtol=0)


async def test_two_ranks_with_the_images_split_over_them_give_the_same_tokens(engine, tiny_llava_next):
    """Tensor parallel 2 with ``mm_encoder_tp_mode="data"``: each rank encodes some of the images, and the gather
    takes each image's own length (the sharded encoder is LLaVA's, tested in test_multimodal_engine.py)."""
    images = [make_image(100, 40, seed=21), make_image(100, 30, seed=22)]
    prompt = {"prompt": "<image> and <image>", "images": images}
    expected = await engine.generate(prompt, GREEDY)
    async with AsyncEngine(tiny_llava_next, disable_log_stats=True, tensor_parallel_size=2, mm_encoder_tp_mode="data",
                           max_num_batched_tokens=128, max_num_seqs=4) as tp2:
        out = await tp2.generate(prompt, GREEDY)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
