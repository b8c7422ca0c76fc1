"""Attention-free Mamba models through the engine: greedy tokens equal transformers' with 16-token chunks, a
prefix-cache hit resuming from saved states, recompute preemption, two tensor-parallel ranks; swap preemption
refused by name (their states, as the hybrids'; speculative decoding rolls the states back as the hybrids':
tests/unit/test_hybrid_drafts.py)."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import greedy_equals_transformers, token_prompts
from hf_reference import hf_greedy
from mamba_utils import make_tiny_mamba

from asyncllm import AsyncEngine, NotBuiltError, SamplingParams


@pytest.mark.parametrize("kind", ["mamba", "falcon_mamba", "mamba2"])
async def test_greedy_equals_transformers_chunked_cached_and_preempted(kind: str, tmp_path) -> None:
    """Five prompts at once over 16 blocks of 4 tokens (recompute preemption), then the first again with two more
    tokens: its states resume from the checkpoint saved at a multiple of 8 tokens."""
    path = make_tiny_mamba(tmp_path, kind)
    prompts = token_prompts(5, seed=4, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=16, block_size=4, mamba_block_size=8,
                           num_gpu_blocks_override=16, max_model_len=64) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        again = await engine.generate(prompts[0] + [7, 8], params)
        stats = engine.stats()
    for prompt, out in zip([*prompts, prompts[0] + [7, 8]], [*outs, again]):
        assert out.token_ids == hf_greedy(path, prompt, 10, eos_token_id=None), f"{len(prompt)} tokens"
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions_total > 0


async def test_two_tensor_parallel_ranks(tmp_path) -> None:
    path = make_tiny_mamba(tmp_path, "mamba2")
    await greedy_equals_transformers(path, token_prompts(3, seed=6), 10, tensor_parallel_size=2)


async def test_swap_preemption_is_refused(tmp_path) -> None:
    path = make_tiny_mamba(tmp_path, "mamba")
    with pytest.raises(NotBuiltError, match="MambaForCausalLM"):
        async with AsyncEngine(path, disable_log_stats=True, preemption_mode="swap"):
            pass
