"""Meituan LongCat-Flash (``LongcatFlashForCausalLM``) through the whole engine: greedy output equals transformers',
token for token, on its tiny checkpoint (two decoder layers of two latent attention blocks each, four cache layers;
the shortcut MoE with identity experts): 16-token chunked prefills and a prefix-cache hit; small chunks with
recompute preemption; two tensor-parallel ranks splitting the experts whole (expert parallel). Logits per position,
the caches per attention block and the split by rows: tests/unit/test_longcat_flash.py."""

from __future__ import annotations

from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers, greedy_equals_transformers, token_prompts

from asyncllm import AsyncEngine
from asyncllm.tiny import tiny_checkpoint


async def test_greedy_equals_transformers_chunked_and_from_the_prefix_cache() -> None:
    path = tiny_checkpoint("longcat_flash")
    async with AsyncEngine(path, max_model_len=64, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=11)


async def test_greedy_equals_transformers_preempted() -> None:
    engine = await greedy_equals_transformers(tiny_checkpoint("longcat_flash"), token_prompts(8, 5), 16,
                                              max_num_batched_tokens=16, num_gpu_blocks_override=10, max_model_len=96)
    assert engine.stats().num_preemptions_total > 0


async def test_greedy_equals_transformers_over_two_ranks_by_expert() -> None:
    """Each rank holds 3 of the 6 routed experts whole (the identity experts on both), half the heads of every
    attention block and half of both dense MLPs' rows."""
    await greedy_equals_transformers(tiny_checkpoint("longcat_flash"), token_prompts(5, 2), 16, tensor_parallel_size=2,
                                     enable_expert_parallel=True)
