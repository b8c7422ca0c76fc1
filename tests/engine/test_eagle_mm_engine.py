"""An EAGLE-3 head drafting for an image-text target (Qwen2.5-VL, M-RoPE): the drafts change how many steps a request
takes, never its tokens.

One engine: the tiny Qwen2.5-VL made to depend on its last input row only, and an EAGLE-3 head in SpecForge's
config (M-RoPE) that computes it exactly (tests/eagle_vl_utils.py), so every greedy draft must be accepted. A prompt
ends inside its image (its first token is read from the image's last feature row), two images sit mid-prompt, a
text prompt runs beside them, images are split across prefill chunks, and the first prompt comes again (a
prefix-cache hit, its image included). Greedy tokens equal transformers'.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from eagle_vl_utils import make_exact_eagle3_pair
from qwen_vl_utils import IMAGE_PAD, IMAGE_PLACEHOLDER, hf_qwen_vl_greedy, make_image, make_tiny_qwen_vl

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import NotBuiltError
from asyncllm.models.eagle_targets import check_multimodal_target

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
BUDGET = 12
"""max_num_batched_tokens: fewer than an image's placeholders, so images are split across steps."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    source = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl"), version="2.5")
    return make_exact_eagle3_pair(source, str(tmp_path_factory.mktemp("eagle3_vl")))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(pair: tuple[str, str]):
    target, head = pair
    async with AsyncEngine(target, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True,
                           speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3}) as engine:
        yield engine


@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_outputs_with_images_and_a_prefix_hit_equal_transformers_every_draft_accepted(engine, pair):
    target = pair[0]
    images = [make_image(60, 200, seed=2), make_image(150, 60, seed=3)]
    ending = f"Describe <|vision_start|>{IMAGE_PAD}"  # its last row is the image's
    middle = f"{IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} and the end"
    cases = [(ending, images[:1]), (ending, images[1:]), ("a text prompt with no image at all", []), (middle, images)]
    prompts = [{"prompt": text, "images": imgs} if imgs else text for text, imgs in cases]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate(prompts[0], GREEDY)  # its prefix, the image included, from the cache
    expected = [hf_qwen_vl_greedy(target, text, imgs, MAX_TOKENS)[1] for text, imgs in cases]
    assert expected[0][0] != expected[1][0]  # the first token is the image's
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == expected[0]
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_acceptance_rate == 1.0


def test_other_drafts_and_targets_are_refused_by_name() -> None:
    with pytest.raises(NotBuiltError, match="a draft model for a multimodal target"):
        check_multimodal_target({}, "draft_model", None, "Qwen2_5_VLForConditionalGeneration")
    with pytest.raises(NotBuiltError, match="LlavaForConditionalGeneration"):
        check_multimodal_target({}, "eagle3", None, "LlavaForConditionalGeneration")
