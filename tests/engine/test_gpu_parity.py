"""On a CUDA device (skipped without one): the whole engine's greedy tokens equal transformers'
for the tiny float32 checkpoints, on the triton backend (the GPU default) and on torch_sdpa."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_TOKENS = 24


@pytest.mark.parametrize("backend", ["triton", "torch_sdpa"])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
async def test_gpu_greedy_parity_fp32(request: pytest.FixtureRequest, fixture: str, backend: str) -> None:
    path = request.getfixturevalue(fixture)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 70))] for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    async with AsyncEngine(path, device="cuda", dtype="float32", attention_backend=backend,
                           max_num_batched_tokens=64, num_gpu_blocks_override=1024,  # not 90% of the GPU
                           disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens diverged"
