"""On a CUDA device (skipped without one): the engine captures its decode CUDA graphs for an ALiBi model (BLOOM) and
a latent-attention model (DeepSeek-V2, a one-part KV cache) on the triton backend, and its greedy tokens equal
transformers'. Their KV writes once selected the valid slots on the host, which fails under stream capture, so
the engine did not start with graphs on (the CPU check of the same forward:
tests/kernels/test_graph_forward_no_host_sync.py). Rounds of 1, 3 and 5 requests replay graphs padded (3 -> 4,
5 -> 8) and at exact sizes as requests finish."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("arch", ["bloom", "deepseek_v2"])
async def test_gpu_graphs_capture_alibi_and_latent_models(arch: str) -> None:
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint(arch)
    rng = random.Random(0)
    async with AsyncEngine(path, device="cuda", dtype="float32", attention_backend="triton", enforce_eager=False,
                           max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=256,
                           kv_cache_memory_bytes=1 << 26, disable_log_stats=True) as engine:
        for size in (1, 3, 5):
            requests = [([rng.randrange(3, 500) for _ in range(rng.randint(3, 30))], rng.randint(2, 12))
                        for _ in range(size)]
            outs = await asyncio.gather(*(engine.generate(p, SamplingParams(temperature=0.0, max_tokens=n))
                                          for p, n in requests))
            for (prompt, max_tokens), out in zip(requests, outs):
                assert out.token_ids == hf_greedy(path, prompt, max_tokens), f"{arch}: {size} requests diverged"
