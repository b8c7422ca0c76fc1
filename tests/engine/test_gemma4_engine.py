"""Gemma 4 through the whole engine (asyncllm/models/gemma4.py, docs/gemma.md#gemma-4): greedy output equals
transformers', token for token, for the tiny E2B-style model (KV-sharing layers, per-layer inputs, sliding and global
layers with KV caches of different shapes) and the tiny 26B-A4B-style one (experts beside the dense MLP): chunked,
from the prefix cache, preempted by recompute and by swapping, over two tensor-parallel ranks (and by expert), and
drafted by itself (speculative decoding)."""

from __future__ import annotations


import pytest
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers, greedy_equals_transformers, token_prompts

from asyncllm import AsyncEngine, NotBuiltError
from asyncllm.tiny import tiny_checkpoint

MAX_TOKENS = 12
ARCHS = ("gemma4", "gemma4_moe")


def _prompts(count: int, seed: int) -> list[list[int]]:
    return token_prompts(count, seed)


async def _greedy_matches_hf(path: str, prompts: list[list[int]], **engine_kwargs: object) -> AsyncEngine:
    return await greedy_equals_transformers(path, prompts, MAX_TOKENS, **engine_kwargs)


@pytest.mark.parametrize("arch", ARCHS)
async def test_gemma4_greedy_equals_transformers_with_a_prefix_hit(arch: str) -> None:
    path = tiny_checkpoint(arch)
    async with AsyncEngine(path, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=len(arch))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
async def test_gemma4_preempted_changes_no_token(preemption_mode: str) -> None:
    """10 blocks for 8 requests: victims recomputed, or their caches of both shapes swapped out and back."""
    engine = await _greedy_matches_hf(tiny_checkpoint("gemma4"), _prompts(8, seed=3), max_num_batched_tokens=16,
                                      num_gpu_blocks_override=10, max_model_len=96, preemption_mode=preemption_mode,
                                      swap_space=0.001)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0
    assert (stats.num_swapped_total > 0) == (preemption_mode == "swap")


@pytest.mark.parametrize("arch, expert_parallel", [("gemma4", False), ("gemma4_moe", False), ("gemma4_moe", True)])
async def test_gemma4_tensor_parallel(arch: str, expert_parallel: bool) -> None:
    """Two ranks: query heads split, the global layers' single KV head replicated, per-layer inputs whole on each;
    the experts split by intermediate dim or by expert."""
    await _greedy_matches_hf(tiny_checkpoint(arch), _prompts(4, seed=5), tensor_parallel_size=2,
                             enable_expert_parallel=expert_parallel)


async def test_gemma4_drafted_by_itself_accepts_every_draft() -> None:
    """The tiny Gemma 4 as its own draft model: the draft's caches of two shapes (and its KV-sharing layers) keep
    step with the target's, so every greedy draft is accepted, and the tokens are transformers'."""
    path = tiny_checkpoint("gemma4")
    engine = await _greedy_matches_hf(path, _prompts(4, seed=7), max_num_batched_tokens=24,
                                      speculative_config={"model": path, "num_speculative_tokens": 3})
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("fields, match", [
    (dict(pipeline_parallel_size=2), "pipeline"),
    (dict(enable_lora=True), "LoRA adapters for Gemma4ForCausalLM"),
])
async def test_gemma4_refuses_what_is_not_built(fields: dict, match: str) -> None:
    with pytest.raises(NotBuiltError, match=match):
        async with AsyncEngine(tiny_checkpoint("gemma4"), disable_log_stats=True, **fields):
            pass
