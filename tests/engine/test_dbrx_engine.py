"""DBRX (asyncllm/models/dbrx.py) through the engine: greedy output equals transformers', token for token, with
small prefill chunks, and over two ranks holding three whole experts each (expert parallel). Its layers' logits
equal transformers' in process (tests/unit/test_dbrx.py, over two tensor-parallel ranks too); LoRA adapters:
tests/engine/test_lora_families_engine.py."""

from __future__ import annotations

from asyncllm.tiny import tiny_checkpoint
from engine_helpers import greedy_equals_transformers, token_prompts

MAX_TOKENS = 16


async def test_dbrx_greedy_equals_transformers_chunked() -> None:
    """Prompts of up to 60 tokens in chunks of at most 16 batched tokens, beside the others' decodes."""
    prompts = token_prompts(6, seed=11)
    assert sum(len(p) > 16 for p in prompts) >= 3  # several prompts span chunks
    await greedy_equals_transformers(tiny_checkpoint("dbrx"), prompts, MAX_TOKENS, max_num_batched_tokens=16,
                                     max_model_len=96)


async def test_dbrx_expert_parallel_over_two_ranks() -> None:
    await greedy_equals_transformers(tiny_checkpoint("dbrx"), token_prompts(4, seed=12), MAX_TOKENS,
                                     tensor_parallel_size=2, enable_expert_parallel=True)
