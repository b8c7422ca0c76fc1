"""An EAGLE-3 head drafting for image-text targets (Qwen2.5-VL with M-RoPE; Llama 4, LLaVA, Gemma 3 with plain
positions): the drafts change how many steps a request takes, never its tokens.

Each target is made to depend on its last input row only, with an EAGLE-3 head in SpecForge's config that computes
it exactly (tests/eagle_vl_utils.py), so every greedy draft must be accepted. Qwen2.5-VL's engine: a prompt ends
inside its image (its first token is read from the image's last feature row), two images sit mid-prompt, a text
prompt runs beside them, images are split across prefill chunks, and the first prompt comes again (a prefix-cache
hit, its image included). Llama 4's, LLaVA's and Gemma 3's: one image and two beside a text prompt. Greedy tokens
equal transformers'.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from eagle_vl_utils import make_exact_eagle3_pair
from gemma3_mm_utils import BOI, hf_gemma3_greedy, make_tiny_gemma3_mm
from llama4_vl_utils import hf_llama4_greedy, make_tiny_llama4_vl
from mm_utils import hf_llava_greedy, make_tiny_llava
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


def eagle3_engine(target: str, head: str, budget: int) -> AsyncEngine:
    """The target with its exact EAGLE-3 head (3 drafts a step), prefix caching, ``budget`` tokens a step."""
    return AsyncEngine(target, disable_log_stats=True, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4,
                       enable_prefix_caching=True,
                       speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(pair: tuple[str, str]):
    async with eagle3_engine(*pair, BUDGET) as engine:
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


FAMILIES = {"llama4": (make_tiny_llama4_vl, hf_llama4_greedy, "<|image|>", 8),
            "llava": (make_tiny_llava, hf_llava_greedy, "<image>", 8),
            "gemma3": (make_tiny_gemma3_mm, hf_gemma3_greedy, BOI, 24)}  # an image's 16 rows attend both ways: one step
"""1-D-rope image-text targets: (make the tiny checkpoint, transformers' greedy, the image marker, the step budget)."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    make, hf_greedy, marker, budget = FAMILIES[request.param]
    source = make(tmp_path_factory.mktemp(request.param))
    target, head = make_exact_eagle3_pair(source, str(tmp_path_factory.mktemp(f"eagle3_{request.param}")))
    return target, head, hf_greedy, marker, budget


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def family_engine(family: tuple):
    target, head, _, _, budget = family
    async with eagle3_engine(target, head, budget) as engine:
        yield engine


@pytest.mark.asyncio(loop_scope="module")
async def test_llama4_llava_gemma3_greedy_outputs_equal_transformers_every_draft_accepted(family_engine, family):
    """Llama 4 (tiles; chunked-attention and expert layers), LLaVA and Gemma 3 (its images attended both ways by the
    target): one image and two, split across chunks (Gemma 3's in one), beside a text prompt; the head reads the
    language model's layers at the tokens' indices."""
    target, _, hf_greedy, marker, _ = family
    cases = [(f"Describe {marker} please", [make_image(70, 50, seed=1)]),
             (f"Compare {marker} and {marker} too", [make_image(30, 28, seed=2), make_image(50, 50, seed=3)]),
             ("a text prompt, no image", [])]
    prompts = [{"prompt": text, "images": imgs} if imgs else text for text, imgs in cases]
    outs = await asyncio.gather(*(family_engine.generate(p, GREEDY) for p in prompts))
    expected = [hf_greedy(target, text, imgs, MAX_TOKENS)[1] for text, imgs in cases]
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = family_engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_acceptance_rate == 1.0


def test_other_drafts_and_targets_are_refused_by_name() -> None:
    with pytest.raises(NotBuiltError, match="a draft model for a multimodal target"):
        check_multimodal_target({}, "draft_model", None, "Qwen2_5_VLForConditionalGeneration")
    with pytest.raises(NotBuiltError, match="Qwen3VLMoeForConditionalGeneration target"):
        check_multimodal_target({}, "eagle3", None, "Qwen3VLMoeForConditionalGeneration")
    for arch in ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                 "Mistral3ForConditionalGeneration", "Llama4ForConditionalGeneration", "Gemma3ForConditionalGeneration"):
        check_multimodal_target({}, "eagle3", None, arch)


def test_an_llava_style_targets_language_model_is_the_decoder_eagle3_reads() -> None:
    """The LLaVA family's decoder is read by its text config's model_type: Llama's stack for LLaVA's, Mistral 3's
    (Mistral), Llama 4's; a type the family does not build has none."""
    from types import SimpleNamespace

    from asyncllm.models.eagle_targets import language_model_class
    from asyncllm.models.llama import LlamaModel

    for arch, model_type in [("LlavaForConditionalGeneration", "llama"), ("LlavaNextForConditionalGeneration", "mistral"),
                             ("Mistral3ForConditionalGeneration", "mistral"), ("Llama4ForConditionalGeneration", "llama4_text")]:
        assert language_model_class(SimpleNamespace(model_type=model_type), arch).model_cls.forward is LlamaModel.forward
    assert language_model_class(SimpleNamespace(model_type="gemma3_text"), "LlavaForConditionalGeneration") is None


def test_the_head_attends_causally_where_the_target_sees_an_image_both_ways() -> None:
    """Gemma 3's image rows attend to their whole image (``attend_limit``) in the target's step; the head's copy of
    the metadata is causal, the target's untouched."""
    import torch

    from asyncllm.attention.metadata import AttentionMetadata
    from asyncllm.models.eagle_targets import causal

    rows = torch.zeros(3, dtype=torch.int32)
    meta = AttentionMetadata(rows.long(), rows, rows, rows[None], [0, 3], [3], 4, attend_limit=torch.tensor([2, 2, 2]))
    assert causal(meta).attend_limit is None and meta.attend_limit is not None
    plain = AttentionMetadata(rows.long(), rows, rows, rows[None], [0, 3], [3], 4)
    assert causal(plain) is plain
