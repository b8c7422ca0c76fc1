"""Greedy outputs equal transformers' `generate`, token for token, whatever the
batch composition, preemption or tensor parallelism (chunk sizes, tiny batches,
swap and priorities: tests/engine/test_async_scheduling.py and test_sched_parity.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncllm import AsyncEngine, SamplingParams
from hf_reference import hf_greedy

NUM_REQUESTS = 14
MAX_TOKENS = 24


def _prompts(vocab: int = 500, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 70))] for _ in range(NUM_REQUESTS)]


async def _run_all(engine: AsyncEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [o.token_ids for o in outs]


def _check(path: str, prompts: list[list[int]], got: list[list[int]]) -> None:
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens diverged"


CASES = {
    "default": {},
    "preempt": {"num_gpu_blocks_override": 12, "max_model_len": 128},
}
"""The synchronous engine's cases; tests/engine/test_async_scheduling.py runs these and chunked prefill, tiny
batches, swap and priorities with TP under the (default) overlapped scheduling."""


@pytest.mark.parametrize("case", list(CASES))
async def test_llama_parity(tiny_llama: str, case: str) -> None:
    prompts = _prompts()
    async with AsyncEngine(tiny_llama, disable_log_stats=True, async_scheduling=False, **CASES[case]) as engine:
        got = await _run_all(engine, prompts)
        stats = engine.stats()
    _check(tiny_llama, prompts, got)
    if case == "preempt":
        assert stats.num_preemptions_total > 0


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_qwen3"])
async def test_qwen_parity(request: pytest.FixtureRequest, fixture: str) -> None:
    path = request.getfixturevalue(fixture)
    prompts = _prompts()
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=32) as engine:
        got = await _run_all(engine, prompts)
    _check(path, prompts, got)


async def test_tensor_parallel_parity(tiny_llama: str) -> None:
    """Chunked (24-token steps) at TP=2; with preemption and priorities: tests/engine/test_async_scheduling.py."""
    prompts = _prompts(seed=1)
    kwargs = dict(max_num_batched_tokens=24)
    async with AsyncEngine(tiny_llama, tensor_parallel_size=2, disable_log_stats=True, **kwargs) as engine:
        got = await _run_all(engine, prompts)
    _check(tiny_llama, prompts, got)


async def test_tensor_parallel_qwen3(tiny_qwen3: str) -> None:
    prompts = _prompts(seed=2)[:6]
    async with AsyncEngine(tiny_qwen3, tensor_parallel_size=2, disable_log_stats=True) as engine:
        got = await _run_all(engine, prompts)
    _check(tiny_qwen3, prompts, got)
