"""Kimi-Linear through the engine over two pipeline stages (the KDA states on each stage's rows, a latent-attention
layer on each), tokens equal transformers'. Its greedy tokens on one stage (chunked, preempted, on reused rows, from
saved states after prefix hits): tests/engine/test_hybrid_engine.py; LoRA adapters:
tests/engine/test_lora_families_engine.py."""

from __future__ import annotations

import asyncio
import random

from hf_reference import hf_greedy

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint


async def test_two_pipeline_stages_equal_transformers() -> None:
    path = tiny_checkpoint("kimi_linear", num_hidden_layers=4, linear_attn_config={
        "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 3], "full_attn_layers": [2, 4]})
    rng = random.Random(3)
    prompts = [[rng.randrange(6, 512) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    async with AsyncEngine(path, pipeline_parallel_size=2, disable_log_stats=True, max_num_batched_tokens=16,
                           max_model_len=96, mamba_block_size=8, block_size=4) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 10, eos_token_id=None)
