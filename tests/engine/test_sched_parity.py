"""Greedy outputs equal transformers' token for token under every scheduling path of issue 3:
preemption by swap (and its fallback to recompute) and by recompute, priority scheduling with
priority preemption, prefix-cache hits, the long-prefill threshold, and whole-prompt scheduling
(chunked prefill off). Four engines; the transformers references are computed once per prompt."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams
from engine_helpers import random_prompts
from hf_reference import hf_greedy

MAX_TOKENS = 24
BYTES_PER_BLOCK = 8192
"""The tiny Llama's KV block: 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes."""


async def _run_all(engine: AsyncEngine, prompts: list[list[int]], priorities: list[int] | None = None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    priorities = priorities or [0] * len(prompts)
    outs = await asyncio.gather(*(engine.generate(p, params, priority=k) for p, k in zip(prompts, priorities)))
    return [o.token_ids for o in outs]


@functools.lru_cache(maxsize=None)
def _reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), MAX_TOKENS)


def _check(path: str, prompts: list[list[int]], got: list[list[int]]) -> None:
    for prompt, tokens in zip(prompts, got):
        assert tokens == _reference(path, tuple(prompt)), f"prompt of {len(prompt)} tokens diverged"


PRESSURE = {"num_gpu_blocks_override": 12, "max_model_len": 128}
"""12 blocks of 16 tokens for 14 requests of up to 94 tokens: preemption is certain."""

CASES = {
    "swap": dict(PRESSURE, preemption_mode="swap", swap_space=0.001),
    "swap-synchronous": dict(PRESSURE, preemption_mode="swap", swap_space=0.001, async_scheduling=False),
    "priority-recompute-threshold": dict(PRESSURE, scheduling_policy="priority", max_num_batched_tokens=32,
                                         long_prefill_token_threshold=8,  # vLLM's partial-prefill caps: 1 caps nothing
                                         max_num_partial_prefills=1, max_long_partial_prefills=1),
    "priority-swap-small-pool": dict(PRESSURE, scheduling_policy="priority", preemption_mode="swap",
                                     swap_space=4 * BYTES_PER_BLOCK / 2**30),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_llama_parity_under_scheduling_policies(tiny_llama: str, case: str) -> None:
    prompts = random_prompts(14, seed=3, stem_len=32)
    prioritised = CASES[case].get("scheduling_policy") == "priority"  # fcfs refuses a priority it would ignore
    priorities = [random.Random(i).randrange(4) if prioritised else 0 for i in range(len(prompts))]
    async with AsyncEngine(tiny_llama, disable_log_stats=True, **CASES[case]) as engine:
        got = await _run_all(engine, prompts, priorities)
        stats = engine.stats()
    _check(tiny_llama, prompts, got)
    assert stats.num_preemptions_total > 0
    if case.startswith("swap"):
        assert stats.num_swapped_total > 0
    if case == "priority-swap-small-pool":  # 4 CPU blocks: some victims swap, longer ones fall back to recompute
        assert stats.num_preemptions_total > stats.num_swapped_total


async def test_prefix_hits_and_whole_prompt_scheduling_give_the_same_tokens(tiny_llama: str) -> None:
    """Chunked prefill off: prompts run whole (longer ones are refused); a second pass hits the prefix cache."""
    prompts = random_prompts(8, seed=4, stem_len=48, max_len=80)
    async with AsyncEngine(tiny_llama, disable_log_stats=True, enable_chunked_prefill=False,
                           max_num_batched_tokens=96) as engine:
        first = await _run_all(engine, prompts)
        before = engine.stats().prefix_cache_hits
        second = await _run_all(engine, prompts)
        hits = engine.stats().prefix_cache_hits - before
        with pytest.raises(InvalidRequestError, match="97 tokens exceed max_num_batched_tokens=96") as info:
            await engine.generate(list(range(3, 100)), SamplingParams(max_tokens=2))
    assert info.value.field == "prompt" and "enable_chunked_prefill=False" in str(info.value)
    # every block but the one holding the last prompt token is cached by the first pass
    assert hits == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert second == first
    _check(tiny_llama, prompts, first)
