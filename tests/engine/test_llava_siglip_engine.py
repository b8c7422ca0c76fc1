"""LLaVA with a SigLIP tower (llava-interleave's layout: every patch's feature of the last layer, not normed,
``"full"``) end to end: an image prompt split across prefill chunks beside a text-only one, greedy tokens and prompts
equal transformers', the checkpoint's SigLIP pooling head left unread; the placeholder count under ``"default"``
(SigLIP's first patch dropped) as transformers' processor counts it; other towers refused by name."""

from __future__ import annotations

import asyncio

import pytest
from mm_utils import IMAGE_TOKEN, NUM_IMAGE_TOKENS, hf_llava_greedy, make_image, make_tiny_llava

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import NotBuiltError
from asyncllm.models.checkpoint import load_hf_config
from asyncllm.models.llava import LlavaForConditionalGeneration

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tiny_llava_siglip(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("llava_siglip"), tower="siglip")


async def test_an_image_prompt_beside_a_text_prompt_matches_transformers(tiny_llava_siglip):
    from safetensors import safe_open

    with safe_open(f"{tiny_llava_siglip}/model.safetensors", "pt") as checkpoint:
        assert any(".head." in name for name in checkpoint.keys())  # the pooling head the loader skips
    image, text = make_image(40, 30, seed=1), f"Describe {IMAGE_TOKEN} please"
    prompts = [{"prompt": text, "images": [image]}, "a text prompt with no image"]
    async with AsyncEngine(tiny_llava_siglip, disable_log_stats=True, block_size=4, max_num_batched_tokens=6,
                           max_num_seqs=2) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_llava_siglip, text, [image], 8)
    image_id = load_hf_config(tiny_llava_siglip).image_token_id
    assert hf_prompt.count(image_id) == NUM_IMAGE_TOKENS  # every patch, no CLS
    assert (outs[0].prompt_token_ids, outs[0].outputs[0].token_ids) == (hf_prompt, hf_tokens)
    assert outs[1].outputs[0].token_ids == hf_llava_greedy(tiny_llava_siglip, prompts[1], [], 8)[1]


def test_default_selection_drops_the_first_patch_as_transformers_processor_counts(tiny_llava_siglip):
    """``"default"`` over SigLIP: transformers drops the first row though it is a patch (no CLS): 15 of 16."""
    from transformers import AutoProcessor

    hf_config = load_hf_config(tiny_llava_siglip)
    hf_config.vision_feature_select_strategy = "default"
    processor = AutoProcessor.from_pretrained(tiny_llava_siglip, vision_feature_select_strategy="default")
    expected = processor._get_num_multimodal_tokens([(56, 56)], crop_size={"height": 56, "width": 56})
    assert LlavaForConditionalGeneration.mm_placeholder_length(hf_config, (3, 56, 56)) == 15
    assert expected["num_image_tokens"] == [15]


def test_other_towers_are_refused_naming_the_built_ones(tiny_llava_siglip):
    import torch

    from asyncllm.models.layers import TensorParallel
    from asyncllm.models.llava_next import LlavaNextForConditionalGeneration

    hf_config = load_hf_config(tiny_llava_siglip)
    hf_config.vision_config.model_type = "siglip2_vision_model"
    with pytest.raises(NotBuiltError, match="clip_vision_model, siglip_vision_model .*pixtral"):
        LlavaForConditionalGeneration.make_vision_tower(hf_config, TensorParallel(), torch.float32)
    hf_config.vision_config.model_type = "siglip_vision_model"  # LLaVA-NeXT counts CLIP's CLS row: CLIP alone
    with pytest.raises(NotBuiltError, match="LlavaNextForConditionalGeneration vision tower of type clip_vision_model"):
        LlavaNextForConditionalGeneration.make_vision_tower(hf_config, TensorParallel(), torch.float32)
