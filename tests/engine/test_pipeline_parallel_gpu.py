"""On CUDA with 2 (4) devices, skipped otherwise: pipeline_parallel_size=2 with tensor_parallel_size 1 (2), NCCL
between the stages and within them; greedy tokens equal transformers' for a 4-layer float32 Llama. The CPU
(gloo) runs: tests/engine/test_pipeline_parallel_engine.py (docs/parallelism.md)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("tp", [1, 2])
async def test_pipeline_stages_on_gpus_equal_transformers(tp: int) -> None:
    if torch.cuda.device_count() < 2 * tp:
        pytest.skip(f"needs {2 * tp} CUDA devices")
    path = tiny_checkpoint("llama", num_layers=4)
    rng = random.Random(tp)
    prompts = [[rng.randrange(6, 500) for _ in range(rng.randint(3, 70))] for _ in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    async with AsyncEngine(path, device="cuda", dtype="float32", pipeline_parallel_size=2, tensor_parallel_size=tp,
                           max_num_batched_tokens=64, num_gpu_blocks_override=1024, kv_cache_memory_bytes=1 << 28,
                           disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 24, eos_token_id=None), f"{len(prompt)} tokens"
