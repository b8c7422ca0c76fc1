"""The hybrids with per-request states through the engine (Qwen3.5 dense and MoE and Qwen3-Next: Gated DeltaNet +
gated full attention; Granite 4.0 and Nemotron-H: Mamba2 + attention; LFM2: short convolutions + attention):
greedy tokens equal transformers' with 16-token chunks, two seats (rows reused by later requests), recompute
preemption and async scheduling; prefix caching is turned off for them, swap preemption and speculative decoding
refused."""

from __future__ import annotations

import asyncio
import random

import pytest
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, NotBuiltError, SamplingParams
from asyncllm.tiny import tiny_checkpoint

MAX_TOKENS = 12


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 512) for _ in range(rng.randint(3, 50))] for _ in range(count)]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "granitemoehybrid", "lfm2",
                                  "nemotron_h", "bamba"])
async def test_greedy_equals_transformers_chunked_preempted_and_on_reused_rows(arch: str) -> None:
    path, prompts = tiny_checkpoint(arch), _prompts(6, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=2,
                           num_gpu_blocks_override=16, block_size=4, max_model_len=64) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts + prompts[:1]))
        stats = engine.stats()
    for prompt, out in zip(prompts + prompts[:1], outs):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"
    assert stats.num_preemptions_total > 0
    assert outs[-1].num_cached_tokens == 0  # prefix caching is off for a hybrid


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.parametrize("fields", [{"preemption_mode": "swap"}, {"speculative_config": NGRAM}])
async def test_swap_preemption_and_speculative_decoding_are_refused(fields: dict) -> None:
    with pytest.raises(NotBuiltError, match="recurrent states"):
        async with AsyncEngine(tiny_checkpoint("qwen3_5"), disable_log_stats=True, **fields):
            pass


async def test_two_tensor_parallel_ranks_equal_transformers() -> None:
    """The full-attention layers split by heads, the linear ones computed whole on each rank (their states too)."""
    path, prompts = tiny_checkpoint("qwen3_5"), _prompts(3, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, tensor_parallel_size=2, max_num_batched_tokens=16) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, MAX_TOKENS, eos_token_id=None) for p in prompts]
