"""LLaVA-OneVision end to end: a SigLIP tower (every patch's feature, not normed), LLaVA-NeXT's anyres packing and
the anyres_max scale-down (set to one tile's worth here, so most grids shrink); greedy tokens and prompts equal
transformers'."""

from __future__ import annotations

import pytest
import pytest_asyncio
from mm_utils import hf_onevision_greedy, make_image, make_tiny_llava_onevision

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_onevision(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava_onevision(tmp_path_factory.mktemp("onevision"), aspect="anyres_max_1")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_onevision: str):
    async with AsyncEngine(tiny_onevision, disable_log_stats=True, block_size=4, max_num_batched_tokens=24,
                           max_num_seqs=4) as engine:
        yield engine


@pytest.mark.parametrize("size", [(100, 40), (100, 30), (90, 90), (40, 100)])
async def test_one_image_matches_transformers(engine, tiny_onevision, size):
    """A 4x8 grid scaled down to 2x5, a 2x8 one left as it is (exactly one tile's worth), an 8x8 and an 8x4 one
    scaled down."""
    image = make_image(*size, seed=sum(size))
    out = await engine.generate({"prompt": "Describe <image> please", "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_onevision_greedy(tiny_onevision, "Describe <image> please", [image], 8)
    assert out.prompt_token_ids == hf_prompt
    assert out.outputs[0].token_ids == hf_tokens


async def test_two_images_in_one_prompt(engine, tiny_onevision):
    images = [make_image(100, 40, seed=7), make_image(40, 100, seed=8)]
    out = await engine.generate({"prompt": "<image> and <image>", "images": images}, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_onevision_greedy(tiny_onevision,
                                                                                   "<image> and <image>", images, 8)
