"""Zamba2 (asyncllm/models/zamba2.py) through the engine: greedy tokens equal transformers' with 16-token chunks,
two seats (rows reused), recompute preemption and states saved in two slots; prompts sharing a 37-token prefix hit
32 tokens and resume from the saved states; over two tensor-parallel ranks (the shared blocks split by heads and
intermediate size, the Mamba2 layers whole); n-gram drafts verified and rolled back. Pipeline stages:
tests/engine/test_pipeline_parallel_own_stages_engine.py; LoRA adapters: tests/engine/test_lora_families_engine.py."""

from __future__ import annotations

import asyncio
import random

import pytest
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint

MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 512) for _ in range(rng.randint(3, 50))] for _ in range(count)]


def _assert_greedy(path: str, prompts: list[list[int]], outs: list) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"


async def test_greedy_equals_transformers_chunked_preempted_and_on_reused_rows() -> None:
    path, prompts = tiny_checkpoint("zamba2"), _prompts(6, seed=5)
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=2,
                           num_gpu_blocks_override=16, block_size=4, max_model_len=64, mamba_block_size=8,
                           mamba_checkpoint_slots=2) as engine:
        outs = await asyncio.gather(*(engine.generate(p, PARAMS) for p in prompts))
        stats = engine.stats()
    _assert_greedy(path, prompts, outs)
    assert stats.num_preemptions_total > 0


@pytest.mark.parametrize("tp", [1, 2])
async def test_prefix_cache_hits_resume_from_saved_states(tp: int) -> None:
    """Every invocation's KV cache and every layer's states: a hit at the last saved point (every 8 tokens) before
    the shared 37-token prefix's end continues as transformers does; over two ranks each saves and loads its own."""
    path, rng = tiny_checkpoint("zamba2"), random.Random(7)
    shared = [rng.randrange(6, 512) for _ in range(37)]
    prompts = [shared + [rng.randrange(6, 512) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=24, max_num_seqs=2, block_size=4,
                           max_model_len=96, mamba_block_size=8, mamba_checkpoint_slots=16,
                           tensor_parallel_size=tp) as engine:
        outs = [await engine.generate(p, PARAMS) for p in prompts]
    _assert_greedy(path, prompts, outs)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]


async def test_ngram_drafts_keep_tokens_equal_to_transformers() -> None:
    """n-gram drafts (from the prompts' repeats) verified and rolled back on every layer's Mamba2 states, the shared
    blocks' KV caches beside. The tiny Zamba2's outputs never repeat, so every draft is rejected here; rows that
    keep some drafts: Mamba2's in tests/unit/test_hybrid_drafts.py."""
    path = tiny_checkpoint("zamba2")
    prompts = [[5, 6, 7, 8, 9] * 6, list(range(10, 30)) * 2] + _prompts(2, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    async with AsyncEngine(path, disable_log_stats=True, speculative_config=spec, max_num_batched_tokens=16,
                           max_num_seqs=2, block_size=4, max_model_len=96, mamba_block_size=8,
                           mamba_checkpoint_slots=4) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        stats = engine.stats()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, 40, eos_token_id=None), f"{len(prompt)} tokens"
    assert stats.spec_decode_num_draft_tokens > 0
