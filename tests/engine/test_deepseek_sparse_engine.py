"""DeepSeek-V3.2 and GLM-5 (asyncllm/models/deepseek_sparse.py) through the engine: greedy tokens equal
transformers' ``generate`` with the tiny models' ``index_topk`` of 6 (prompts of up to 60 tokens: sparse prefill
chunks and decodes), in 16-token chunks that cross it, with recompute preemption and a prefix-cache hit (the latent
and indexer caches share their blocks), and over two tensor-parallel ranks (the indexer whole on each)."""

from __future__ import annotations

import pytest

from asyncllm.tiny import tiny_checkpoint
from engine_helpers import greedy_equals_transformers, token_prompts

MAX_TOKENS = 16


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
async def test_sparse_greedy_chunked_preempted_and_from_the_prefix_cache(arch: str) -> None:
    prompts = token_prompts(6, seed=5)
    engine = await greedy_equals_transformers(tiny_checkpoint(arch), prompts + prompts[:2], MAX_TOKENS,
                                              max_num_batched_tokens=16, num_gpu_blocks_override=12, max_model_len=96)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits + stats.preempted_prefix_cache_hits > 0


async def test_sparse_over_two_ranks() -> None:
    await greedy_equals_transformers(tiny_checkpoint("deepseek_v32"), token_prompts(4, seed=7), MAX_TOKENS,
                                     tensor_parallel_size=2)
