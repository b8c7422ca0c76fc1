"""Phi-4-multimodal end to end (one engine, the tiny checkpoint through the real loader): prompt ids and greedy tokens
equal transformers' for an image (HD crops with padding), an audio alone, an image with an audio (the audio's other
projection) and text alone, batched across prefill chunks, then from the caches (the crops' other layouts:
tests/unit/test_phi4_multimodal.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
from mm_utils import make_image
from phi4_mm_utils import AUDIO_TOKEN, IMAGE_TOKEN, hf_phi4_greedy, make_tiny_phi4_mm

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
RATE = 16000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_phi4_mm(tmp_path_factory.mktemp("phi4_mm"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny: str):
    async with AsyncEngine(tiny, disable_log_stats=True, block_size=16, max_num_batched_tokens=256,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


def audio(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(RATE * seconds)) * 0.1).astype(np.float32)


PROMPTS = {  # name: (text, images as (width, height, seed), audios as (seconds, seed))
    "2 x 1 crops, padded": (f"Describe {IMAGE_TOKEN} please", [(600, 250, 1)], []),
    "image and audio": (f"{IMAGE_TOKEN} and {AUDIO_TOKEN} together", [(300, 500, 3)], [(1.0, 4)]),
    "audio alone": (f"Transcribe {AUDIO_TOKEN}", [], [(1.0, 4)]),
    "text alone": ("A text-only prompt", [], []),
}


async def test_images_audios_and_text_in_one_batch_match_transformers(engine, tiny):
    """Every prompt of `PROMPTS` batched across 256-token prefill chunks: prompt ids and greedy tokens equal
    transformers' (eager attention: tests/phi4_mm_utils.py); the same audio alone and beside an image gets each its
    own projection. Then the image-and-audio prompt again: its prefix from the cache, the same tokens."""
    images = {name: [make_image(*size) for size in sizes] for name, (_, sizes, _) in PROMPTS.items()}
    audios = {name: [audio(*spec) for spec in specs] for name, (_, _, specs) in PROMPTS.items()}

    def prompt(name: str) -> dict:
        return {"prompt": PROMPTS[name][0], "images": images[name], "audios": [(a, RATE) for a in audios[name]]}

    outs = await asyncio.gather(*(engine.generate(prompt(name), GREEDY) for name in PROMPTS))
    expected = {name: hf_phi4_greedy(tiny, PROMPTS[name][0], images[name], audios[name], 8) for name in PROMPTS}
    for name, out in zip(PROMPTS, outs):
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == expected[name], name
    assert len(expected["2 x 1 crops, padded"][0]) > 256  # over one prefill chunk
    again = await engine.generate(prompt("image and audio"), GREEDY)
    assert again.outputs[0].token_ids == expected["image and audio"][1]
    assert again.num_cached_tokens > 0
