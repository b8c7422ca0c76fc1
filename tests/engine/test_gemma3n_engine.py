"""Gemma 3n through the whole engine (asyncllm/models/gemma3n.py, docs/gemma.md#gemma-3n): greedy output equals
transformers', token for token, for the tiny E2B-style model (AltUp streams, LAuReL, sparse gates, per-layer inputs,
KV-sharing layers): chunked, from the prefix cache, preempted, and over two tensor-parallel ranks (the sparse gates'
statistics all-reduced over the split intermediate width). Pipeline stages:
tests/engine/test_pipeline_parallel_own_stages_engine.py."""

from __future__ import annotations

from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers, greedy_equals_transformers, token_prompts

from asyncllm import AsyncEngine
from asyncllm.tiny import tiny_checkpoint

MAX_TOKENS = 12


async def test_gemma3n_greedy_equals_transformers_with_a_prefix_hit() -> None:
    path = tiny_checkpoint("gemma3n")
    async with AsyncEngine(path, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=7)


async def test_gemma3n_preempted_changes_no_token() -> None:
    engine = await greedy_equals_transformers(tiny_checkpoint("gemma3n"), token_prompts(8, seed=3), MAX_TOKENS,
                                              max_num_batched_tokens=16, num_gpu_blocks_override=10, max_model_len=96)
    assert engine.stats().num_preemptions_total > 0


async def test_gemma3n_tensor_parallel() -> None:
    await greedy_equals_transformers(tiny_checkpoint("gemma3n"), token_prompts(4, seed=5), MAX_TOKENS,
                                     tensor_parallel_size=2, max_num_batched_tokens=16)

