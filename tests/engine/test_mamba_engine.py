"""Attention-free Mamba models through the engine: greedy tokens equal transformers' with 16-token chunks, a
prefix-cache hit resuming from saved states, recompute preemption, two tensor-parallel ranks, two pipeline stages
with a LoRA adapter beside (the stages bit for bit against the unsplit model: tests/unit/test_mamba_models.py; the
adapters' logits: tests/unit/test_lora_models.py); swap preemption refused by name (their
states, as the hybrids'; speculative decoding rolls the states back as the hybrids': tests/unit/test_hybrid_drafts.py)."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import greedy_equals_transformers, token_prompts
from hf_reference import hf_greedy
from lora_utils import make_adapter, merged_greedy
from mamba_utils import make_tiny_mamba

from asyncllm import AsyncEngine, LoRARequest, NotBuiltError, SamplingParams


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
    assert stats.prefix_cache_hits + stats.preempted_prefix_cache_hits > 0 and stats.num_preemptions_total > 0


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])  # Falcon Mamba's mixer is Mamba's (its stages: unit-tested)
async def test_two_pipeline_stages_with_an_adapter(kind: str, tmp_path) -> None:
    """One layer a stage, each keeping its layer's states (a prefix-cache hit restores both stages' saved states)
    and passing the float32 stream on; beside a request, the same prompt with a LoRA adapter on the mixers' projections
    PEFT adapts (Mamba2's ``in_proj``; Mamba's ``x_proj`` and ``dt_proj`` too), each stage its layer's: the tokens
    of transformers with the adapter merged into the weights (PEFT's unmerged ``dt_proj`` adapter is bypassed by
    transformers' Mamba, which reads the weight itself)."""
    path = make_tiny_mamba(tmp_path / "base", kind)
    targets = ["in_proj"] if kind == "mamba2" else ["in_proj", "x_proj", "dt_proj"]
    adapter = make_adapter(path, str(tmp_path / "lora"), seed=3, rank=4, alpha=8, targets=targets)
    prompt = [(37 * i + len(kind)) % 500 + 6 for i in range(37)]  # three chunks; its first 32 tokens' states saved
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(path, pipeline_parallel_size=2, disable_log_stats=True, max_num_batched_tokens=16,
                           block_size=4, mamba_block_size=8, max_model_len=96, max_num_seqs=4, enable_lora=True,
                           max_lora_rank=8) as engine:
        base, adapted = await asyncio.gather(engine.generate(prompt, params), engine.generate(
            prompt, params, lora_request=LoRARequest("a", 1, adapter)))
        again = await engine.generate(prompt + [7, 8], params)
        assert engine.stats().prefix_cache_hits > 0
    assert base.token_ids == hf_greedy(path, prompt, 8, eos_token_id=None)
    assert again.token_ids == hf_greedy(path, prompt + [7, 8], 8, eos_token_id=None)
    assert adapted.token_ids == merged_greedy(path, adapter, prompt, 8) != base.token_ids


async def test_two_tensor_parallel_ranks(tmp_path) -> None:
    path = make_tiny_mamba(tmp_path, "mamba2")
    await greedy_equals_transformers(path, token_prompts(3, seed=6), 10, tensor_parallel_size=2)


async def test_swap_preemption_is_refused(tmp_path) -> None:
    path = make_tiny_mamba(tmp_path, "mamba")
    with pytest.raises(NotBuiltError, match="MambaForCausalLM"):
        async with AsyncEngine(path, disable_log_stats=True, preemption_mode="swap"):
            pass
