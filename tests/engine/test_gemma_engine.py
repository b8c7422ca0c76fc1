"""Gemma 2 and Gemma 3 through the whole engine: greedy output equals transformers', token for token, with
prompts longer than the tiny models' 8-token sliding window, 16-token chunked prefill and a prefix-cache hit.
Gemma 2 over two tensor-parallel ranks: tests/unit/test_tp_layers.py (gloo ranks, logits equal one rank's). LoRA
on a Gemma 3 image-text checkpoint equals PEFT."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers

from asyncllm import AsyncEngine, InvalidRequestError
from asyncllm.tiny import tiny_checkpoint


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
async def test_gemma_greedy_equals_transformers(arch: str) -> None:
    path = tiny_checkpoint(arch)
    async with AsyncEngine(path, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=len(arch))


async def test_lora_on_a_gemma3_image_text_checkpoint_equals_peft(tmp_path) -> None:
    """An image-text checkpoint (served as text: ``limit_mm_per_prompt`` of 0 images) with a PEFT adapter made on it: its matrices are named
    ``model.language_model.layers...`` and, for ``q_proj`` and the like, the SigLIP tower's too (never run on
    text). The adapter's tokens and the base model's, batched together, equal PEFT's and transformers'; with images the
    same adapter is refused for its tower's matrices."""
    import shutil

    import transformers

    from asyncllm import LoRARequest, SamplingParams
    from asyncllm.models.loader import load_hf_config
    from engine_helpers import random_prompts
    from hf_reference import hf_greedy
    from lora_utils import make_adapter, peft_greedy

    text = tiny_checkpoint("gemma3")
    path = str(tmp_path / "gemma3-it")
    shutil.copytree(text, path)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=load_hf_config(text).to_dict(), vision_config=vision,
                                       mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(config)
    text_model = transformers.AutoModelForCausalLM.from_pretrained(text)  # the tiny decoder's weights
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    model.save_pretrained(path)
    adapter = make_adapter(path, str(tmp_path / "adapter"), seed=1, targets=["q_proj", "v_proj", "o_proj"])
    lora = LoRARequest("it", 1, adapter)
    prompts = random_prompts(4, seed=21, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(path, enable_lora=True, limit_mm_per_prompt={"image": 0}, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params, lora_request=lora if i % 2 else None)
                                      for i, p in enumerate(prompts)))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        expected = (peft_greedy(path, adapter, prompt, 8, eos_token_id=None) if i % 2
                    else hf_greedy(path, prompt, 8, eos_token_id=None))
        assert out.token_ids == expected, i
    assert any(out.token_ids != hf_greedy(path, p, 8, eos_token_id=None) for p, out in list(zip(prompts, outs))[1::2])
    from asyncllm.lora_checker import AdapterChecker

    with_images = AdapterChecker(load_hf_config(path).text_config, 8, runs_tower=True)  # as prepare builds it then
    with pytest.raises(InvalidRequestError, match="adapters on the vision tower and projector are not built"):
        with_images.check(lora)
