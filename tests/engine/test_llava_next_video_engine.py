"""LLaVA-NeXT-Video end to end on one engine: videos (frames shrunk, enlarged, used as they are), images beside them,
and text alone; greedy tokens and prompts equal transformers', the items split across prefill chunks, batched
together and hit in the prefix cache. The frames' pixels and the pooled features: tests/unit/test_llava_video.py."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from llava_next_video_utils import hf_llava_next_video_greedy, make_tiny_llava_next_video
from mm_utils import make_image
from qwen_vl_utils import make_video

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_video(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava_next_video(tmp_path_factory.mktemp("llava_next_video"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_video: str):
    async with AsyncEngine(tiny_video, disable_log_stats=True, block_size=4, max_num_batched_tokens=24,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


async def _check(engine, path: str, text: str, images: list, videos: list) -> None:
    out = await engine.generate({"prompt": text, "images": images, "videos": videos}, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_llava_next_video_greedy(path, text, images, videos, 8)


async def test_videos_images_and_text_match_transformers(engine, tiny_video):
    """A video of 80x60 frames (resized to 74x56, its middle cropped); one of 30x40 (enlarged) and one of 56x56 (as
    it is) beside an image, encoded in one call (transformers takes a prompt's videos of one frame count only); text
    alone. 7 frames: 28 placeholders, over one prefill chunk."""
    await _check(engine, tiny_video, "Watch <video> now", [], [make_video(7, 80, 60, seed=1)])
    await _check(engine, tiny_video, "<image> then <video> and <video>", [make_image(100, 40, seed=2)],
                 [make_video(3, 30, 40, seed=3), make_video(3, 56, 56, seed=4)])
    await _check(engine, tiny_video, "Just some text here", [], [])


async def test_batched_and_prefix_cached_requests_match_transformers(engine, tiny_video):
    """A video request and an image request at once, then the video's again: its prefix (through the video) hit."""
    video, image = make_video(4, 70, 50, seed=5), make_image(40, 100, seed=6)
    prompts = [("A <video> b", [], [video]), ("C <image> d", [image], [])]
    outs = await asyncio.gather(*(engine.generate({"prompt": t, "images": i, "videos": v}, GREEDY)
                                  for t, i, v in prompts))
    for (text, images, videos), out in zip(prompts, outs):
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_llava_next_video_greedy(
            tiny_video, text, images, videos, 8)
    again = await engine.generate({"prompt": "A <video> b", "videos": [video]}, GREEDY)
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == outs[0].outputs[0].token_ids
