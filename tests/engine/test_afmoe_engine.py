"""Arcee AFMoE (Trinity, ``AfmoeForCausalLM``) through the whole engine: greedy output equals transformers', token
for token, on its tiny checkpoint (an 8-token sliding layer that rotates, a global layer without positions with
experts, gated attention, muP embeddings): 16-token chunked prefills and a prefix-cache hit past the window;
small chunks with recompute preemption; two tensor-parallel ranks splitting the experts whole (expert parallel);
prompts given as embeddings (muP scales them too). Logits per position and the tensor-parallel split by rows:
tests/unit/test_afmoe.py."""

from __future__ import annotations

import torch
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers, greedy_equals_transformers, token_prompts
from hf_reference import hf_embeds_greedy, hf_input_embeddings

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint


async def test_greedy_equals_transformers_chunked_and_from_the_prefix_cache() -> None:
    path = tiny_checkpoint("afmoe")
    async with AsyncEngine(path, max_model_len=64, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=11)


async def test_greedy_equals_transformers_preempted() -> None:
    engine = await greedy_equals_transformers(tiny_checkpoint("afmoe"), token_prompts(8, 5), 16,
                                              max_num_batched_tokens=16, num_gpu_blocks_override=10, max_model_len=96)
    assert engine.stats().num_preemptions_total > 0


async def test_greedy_equals_transformers_over_two_ranks_by_expert() -> None:
    """Each rank holds 4 of the 8 experts whole, half the heads (and their rows of the output gate) and half the
    shared expert's rows."""
    await greedy_equals_transformers(tiny_checkpoint("afmoe"), token_prompts(5, 2), 16, tensor_parallel_size=2,
                                     enable_expert_parallel=True)


async def test_prompt_embeds_are_scaled_as_transformers_scales_them() -> None:
    """A prompt given as its (unscaled) input embeddings: the model multiplies them by sqrt(hidden) as transformers'
    does its ``inputs_embeds``, so the greedy tokens equal transformers' from the same embeddings."""
    path = tiny_checkpoint("afmoe")
    embeds = hf_input_embeddings(path, token_prompts(1, 6)[0])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(path, max_model_len=64, enable_prompt_embeds=True, disable_log_stats=True) as engine:
        out = await engine.generate({"prompt_embeds": embeds.to(torch.float32)}, params)
    assert out.token_ids == hf_embeds_greedy(path, embeds, 8)
