"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy output equals transformers',
token for token, alone, chunked, preempted, and split over two ranks by intermediate dim or by expert."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.tiny import tiny_checkpoint
from hf_reference import hf_greedy

MAX_TOKENS = 16
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 512) for _ in range(rng.randint(3, 60))] for _ in range(count)]


async def _greedy_matches_hf(path: str, prompts: list[list[int]], **engine_kwargs: object) -> AsyncEngine:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, **engine_kwargs) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"
    return engine


@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_moe_greedy_equals_transformers(arch: str) -> None:
    await _greedy_matches_hf(tiny_checkpoint(arch), _prompts(8, seed=0))


async def test_moe_parity_chunked_and_preempted() -> None:
    """Dense and MoE layers mixed (Qwen3-MoE's mlp_only_layers), small chunks, recompute preemption."""
    path = tiny_checkpoint("qwen3_moe", mlp_only_layers=[1])
    engine = await _greedy_matches_hf(path, _prompts(8, seed=1), max_num_batched_tokens=16,
                                      num_gpu_blocks_override=10, max_model_len=96)
    assert engine.stats().num_preemptions_total > 0


@pytest.mark.parametrize("arch, expert_parallel", [("mixtral", False), ("qwen2_moe", True), ("qwen3_moe", True)])
async def test_moe_tensor_and_expert_parallel(arch: str, expert_parallel: bool) -> None:
    await _greedy_matches_hf(tiny_checkpoint(arch), _prompts(5, seed=2), tensor_parallel_size=2,
                             enable_expert_parallel=expert_parallel)


async def test_expert_parallel_needs_experts(tiny_llama: str) -> None:
    with pytest.raises(ConfigError, match="enable_expert_parallel.*mixture-of-experts"):
        async with AsyncEngine(tiny_llama, enable_expert_parallel=True):
            pass


async def test_lora_on_moe_is_not_built() -> None:
    with pytest.raises(NotBuiltError, match="LoRA adapters for Qwen3MoeForCausalLM"):
        async with AsyncEngine(tiny_checkpoint("qwen3_moe"), enable_lora=True):
            pass
