"""Gemma 2 and Gemma 3 through the whole engine: greedy output equals transformers', token for token, with
prompts longer than the tiny models' 8-token sliding window, 16-token chunked prefill and a prefix-cache hit.
Gemma 2 over two tensor-parallel ranks: tests/unit/test_tp_layers.py (gloo ranks, logits equal one rank's)."""

from __future__ import annotations

import pytest
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers

from asyncllm import AsyncEngine
from asyncllm.errors import NotBuiltError
from asyncllm.tiny import tiny_checkpoint


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
async def test_gemma_greedy_equals_transformers(arch: str) -> None:
    path = tiny_checkpoint(arch)
    async with AsyncEngine(path, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=len(arch))


async def test_lora_on_gemma3_image_text_checkpoints_is_not_built(tmp_path) -> None:
    """Gemma 2 / Gemma 3 text adapters: tests/engine/test_lora_engine.py. An image-text checkpoint's (its
    adapters' names and vision-tower targets are not mapped) is refused before anything starts."""
    import shutil

    import transformers

    from asyncllm.models.loader import load_hf_config

    text = tiny_checkpoint("gemma3")
    shutil.copytree(text, tmp_path, dirs_exist_ok=True)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    transformers.Gemma3Config(text_config=load_hf_config(text).to_dict(), vision_config=vision,
                              architectures=["Gemma3ForConditionalGeneration"]).save_pretrained(tmp_path)
    with pytest.raises(NotBuiltError, match="LoRA adapters for Gemma3ForConditionalGeneration"):
        async with AsyncEngine(str(tmp_path), enable_lora=True):
            pass
