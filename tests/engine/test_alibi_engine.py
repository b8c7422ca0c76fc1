"""BLOOM and MPT (ALiBi attention: asyncllm/models/alibi.py) through the engine: greedy output equals
transformers', token for token, with small prefill chunks over cached prefixes, under preemption (too few KV blocks
for the batch: requests recomputed), after prefix-cache hits, and over two tensor-parallel ranks (each with its heads'
slopes), over two pipeline stages, and with a LoRA adapter on the fused q/k/v (equal to PEFT's; one engine per
family, adapters enabled, serves the chunked, prefix-hit and LoRA cases). Their logits equal transformers' in process
(tests/unit/test_alibi_models.py, tests/unit/test_lora_models.py)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, LoRARequest, SamplingParams
from asyncllm.tiny import tiny_checkpoint
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers, greedy_equals_transformers, token_prompts

MAX_TOKENS = 16
SIX_HEADS = dict(num_heads=6, num_kv_heads=6, hidden_size=96)
"""Six heads: BLOOM's and MPT's slopes for a head count that is not a power of two."""


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["bloom", "mpt"])
async def served(request: pytest.FixtureRequest):
    """One engine per family (16-token chunks, adapters enabled) shared by the chunked / prefix-hit and LoRA tests:
    (engine, checkpoint)."""
    path = tiny_checkpoint(request.param, **SIX_HEADS)
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=16, max_model_len=96,
                           enable_lora=True, max_lora_rank=8) as engine:
        yield engine, path


@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_equals_transformers_chunked_and_after_prefix_cache_hits(served) -> None:
    """Prompts of up to 60 tokens in chunks of at most 16 batched tokens, beside the others' decodes; then prompts
    whose first blocks the prefix cache holds."""
    from hf_reference import hf_greedy

    engine, path = served
    prompts = token_prompts(6, seed=21)
    assert sum(len(p) > 16 for p in prompts) >= 3  # several prompts span chunks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"
    await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=23)


@pytest.mark.parametrize("arch", ["bloom"])  # recompute is the scheduler's, not the model's: MPT's prefills above
async def test_greedy_equals_transformers_under_preemption(arch: str) -> None:
    """Eight blocks of 16 tokens for six requests of up to 76 tokens: requests are preempted and recomputed."""
    engine = await greedy_equals_transformers(tiny_checkpoint(arch), token_prompts(6, seed=22), MAX_TOKENS,
                                              num_gpu_blocks_override=8, max_model_len=128)
    assert engine.stats().num_preemptions_total > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bloom", "mpt"])
async def test_greedy_over_two_tensor_parallel_ranks(arch: str) -> None:
    await greedy_equals_transformers(tiny_checkpoint(arch, **SIX_HEADS), token_prompts(4, seed=24), MAX_TOKENS,
                                     tensor_parallel_size=2, max_num_batched_tokens=24)


@pytest.mark.slow
async def test_bloom_greedy_over_two_pipeline_stages() -> None:
    """The first stage LayerNorms the embeddings (``word_embeddings_layernorm``), the last holds the tied head."""
    await greedy_equals_transformers(tiny_checkpoint("bloom", **SIX_HEADS), token_prompts(4, seed=25), MAX_TOKENS,
                                     pipeline_parallel_size=2, max_num_batched_tokens=16, max_model_len=128)


@pytest.mark.asyncio(loop_scope="module")
async def test_lora_greedy_equals_peft(served, tmp_path) -> None:
    """An adapter on every projection (BLOOM's per-head fused ``query_key_value``, MPT's ``Wqkv``) beside a request
    without it: the host checks its shapes, the workers cut its B as the weight; both outputs equal PEFT's and
    transformers'."""
    from hf_reference import hf_greedy
    from lora_utils import make_adapter, peft_greedy

    engine, path = served
    adapter = make_adapter(path, str(tmp_path / "adapter"), seed=3, rank=4, alpha=8, targets="all-linear")
    prompt = token_prompts(1, seed=26)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    adapted = await engine.generate(prompt, greedy, lora_request=LoRARequest("a", 1, adapter))
    base = await engine.generate(prompt, greedy)
    assert adapted.token_ids == peft_greedy(path, adapter, prompt, MAX_TOKENS, eos_token_id=None)
    assert base.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None) != adapted.token_ids
