"""The CPU prefix-cache tier (``kv_offloading_size``, vLLM's): cached blocks evicted from a small GPU cache are copied
to CPU memory and loaded back when a prompt's prefix hits them, so the tokens are those computed without a hit,
on one rank and on two with an fp8 cache; hybrids refuse it by name."""

from __future__ import annotations

import pytest

from asyncllm import AsyncEngine, NotBuiltError, SamplingParams
from asyncllm.tiny import tiny_checkpoint
from hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(3 + 100 * i, 67 + 100 * i)) for i in range(3)]  # 64 tokens each: 4 blocks of 16


@pytest.mark.parametrize("fields", [{}, {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8"}])
async def test_evicted_prefixes_come_back_from_cpu_memory(tiny_llama: str, fields: dict) -> None:
    async with AsyncEngine(tiny_llama, disable_log_stats=True, num_gpu_blocks_override=8, max_model_len=128,
                           kv_offloading_size=0.01, **fields) as engine:  # 8 GPU blocks: two prompts' worth
        first = [await engine.generate(p, GREEDY) for p in PROMPTS]  # the later ones evict the earlier ones' blocks
        before = engine.stats().prefix_cache_hits
        again = await engine.generate(PROMPTS[0], GREEDY)
        hits = engine.stats().prefix_cache_hits - before
        assert engine.stats().cpu_prefix_cache_hits == 48  # all from the CPU tier
    assert hits == 48  # its 3 full blocks (the last token is recomputed), none of them still on the GPU
    assert again.token_ids == first[0].token_ids
    if not fields:
        assert again.token_ids == hf_greedy(tiny_llama, PROMPTS[0], 8, eos_token_id=None)


async def test_without_the_cpu_tier_the_evicted_prefix_is_recomputed(tiny_llama: str) -> None:
    async with AsyncEngine(tiny_llama, disable_log_stats=True, num_gpu_blocks_override=8,
                           max_model_len=128) as engine:
        for p in PROMPTS:
            await engine.generate(p, GREEDY)
        before = engine.stats().prefix_cache_hits
        await engine.generate(PROMPTS[0], GREEDY)
        assert engine.stats().prefix_cache_hits == before


async def test_hybrids_refuse_the_cpu_tier() -> None:
    with pytest.raises(NotBuiltError, match="kv_offloading_size"):
        async with AsyncEngine(tiny_checkpoint("qwen3_5"), disable_log_stats=True, kv_offloading_size=1.0):
            pass
