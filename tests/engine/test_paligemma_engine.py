"""PaliGemma 1 (Gemma decoder) and PaliGemma 2 (Gemma 2 decoder) end to end: prompts laid out as
``PaliGemmaProcessor`` writes them (``<image>`` rows, ``<bos>``, the text, a newline), each whole prompt attending
to itself both ways in its one-chunk prefill, positions from 1; greedy tokens equal transformers' for image and
text prompts batched under a 40-token step budget, from the prefix cache for a repeat, and with no block reused
by a prompt that shares the image but not the text (the image rows' KV depends on the text after them)."""

from __future__ import annotations

import asyncio

import pytest
from mm_utils import make_image
from paligemma_utils import SLIDING_WINDOW, hf_paligemma_greedy, make_tiny_paligemma

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("generation", [1, 2])
async def test_image_and_text_prompts_match_transformers_with_and_without_prefix_cache_hits(generation,
                                                                                          tmp_path_factory):
    path = make_tiny_paligemma(tmp_path_factory.mktemp(f"paligemma{generation}"), generation)
    image, other = make_image(50, 40, seed=1), make_image(30, 60, seed=2)
    prompts = [{"prompt": "caption en", "images": [image]},
               {"prompt": "<image><image>compare them", "images": [other, image]}, "hello there world"]
    shared_image = {"prompt": "caption fr", "images": [image]}
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=40,
                           max_num_seqs=4) as engine:
        outs = await asyncio.gather(*(engine.generate(prompt, GREEDY) for prompt in prompts))
        again = await asyncio.gather(*(engine.generate(prompt, GREEDY) for prompt in (prompts[0], prompts[2])))
        shared = await engine.generate(shared_image, GREEDY)
        if generation == 2:
            with pytest.raises(InvalidRequestError, match="sliding_window"):
                await engine.generate({"prompt": "a long prompt " * 8, "images": [image]}, GREEDY)
    for prompt, out in zip([*prompts, prompts[0], prompts[2], shared_image], [*outs, *again, shared]):
        text, images = (prompt, []) if isinstance(prompt, str) else (prompt["prompt"], prompt["images"])
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_paligemma_greedy(path, text, images, 10), text
    assert all(out.num_cached_tokens >= 8 for out in again)
    assert shared.num_cached_tokens == 0
    assert len(outs[1].prompt_token_ids) <= SLIDING_WINDOW < len(outs[1].prompt_token_ids) + 10
    for text, images in (("caption en", [image]), (prompts[2], [])):  # the prefix attention matters
        assert hf_paligemma_greedy(path, text, images, 10)[1] != hf_paligemma_greedy(path, text, images, 10,
                                                                                      bidirectional=False)[1]
