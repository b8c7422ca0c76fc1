"""The central invariant under random schedules: a seed draws an engine configuration (overlapped or synchronous
steps, the workers' pipelined steps, prefix caching, a KV cache small enough to preempt by recompute or swap,
chunk budgets, priorities, long-prefill caps), a request mix (shared stems for prefix hits, staggered arrivals,
streams aborted part-way) and sampling settings; whatever the draw, greedy outputs equal transformers' token
for token, seeded sampling equals a roomy synchronous engine that runs one request at a time, and the engine
ends idle with no KV block held.

Each seed is one draw; a failure names its seed and configuration. Longer runs of the same draws, and the one
difference they met: docs/scheduling.md, "Random schedules".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from typing import Any

import pytest

from asyncllm import AsyncEngine, SamplingParams
from engine_helpers import wait_idle, worker_pipeline_on
from hf_reference import hf_greedy

MAX_MODEL_LEN = 128
MAX_TOKENS = 40
MAX_PROMPT = MAX_MODEL_LEN - MAX_TOKENS


@functools.lru_cache(maxsize=None)
def _reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    """transformers' greedy tokens, MAX_TOKENS of them: a request of max_tokens m gets the first m (greedy
    decoding of m tokens is the first m of a longer one, EOS included)."""
    return hf_greedy(path, list(prompt), MAX_TOKENS)


def _config(rng: random.Random) -> dict[str, Any]:
    """An engine configuration: most draws keep the KV cache small enough to preempt."""
    budget = rng.choice([16, 24, 64, 2048])
    config: dict[str, Any] = dict(
        disable_log_stats=True, max_model_len=MAX_MODEL_LEN, async_scheduling=rng.random() < 0.7,
        enable_prefix_caching=rng.random() < 0.7, num_gpu_blocks_override=rng.choice([9, 12, 20, 64]),
        max_num_batched_tokens=budget, max_num_seqs=min(budget, rng.choice([1, 2, 4, 8, 16])))
    if rng.random() < 0.3:
        config["scheduling_policy"] = "priority"
    if rng.random() < 0.25:
        config.update(preemption_mode="swap", swap_space=rng.choice([0.0001, 0.001]))
    if rng.random() < 0.2:
        config["long_prefill_token_threshold"] = rng.choice([8, 16])
    return config


def _prompts(rng: random.Random) -> list[list[int]]:
    """3 to 24 prompts of ordinary token ids; about half start with a shared stem (prefix-cache hits)."""
    stem = [rng.randrange(3, 500) for _ in range(rng.choice([0, 16, 20, 33]))]
    prompts = []
    for _ in range(rng.randint(3, 24)):
        head = stem if rng.random() < 0.5 else []
        prompts.append(head + [rng.randrange(3, 500) for _ in range(rng.randint(1, MAX_PROMPT - len(head)))])
    return prompts


def _sampling(rng: random.Random) -> SamplingParams:
    """Seeded sampling or greedy, with some of the penalties, biases, floors and stops a request may carry."""
    max_tokens = rng.randint(1, MAX_TOKENS)
    greedy = rng.random() < 0.25
    kw: dict[str, Any] = dict(max_tokens=max_tokens, seed=rng.randrange(1 << 30),
                              temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.5]))
    if not greedy and rng.random() < 0.4:
        kw["top_p"] = rng.choice([0.5, 0.9])
    if not greedy and rng.random() < 0.4:
        kw["top_k"] = rng.choice([1, 5, 50])
    if not greedy and rng.random() < 0.2:
        kw["min_p"] = 0.05
    if rng.random() < 0.3:
        kw["presence_penalty"] = rng.choice([0.5, -0.5])
    if rng.random() < 0.3:
        kw["frequency_penalty"] = 0.3
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([1.2, 0.9])
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, min(5, max_tokens))
    if rng.random() < 0.3:
        kw["stop_token_ids"] = [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(3, 500): 5.0}
    if rng.random() < 0.15:
        kw["n"] = 2
    return SamplingParams(**kw)


async def _greedy(engine: AsyncEngine, prompt: list[int], max_tokens: int, priority: int, delay: float,
                  abort_after: int | None) -> list[int]:
    """The request's tokens: the whole output, or the first ``abort_after`` streamed before the stream is closed."""
    await asyncio.sleep(delay)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if abort_after is None:
        return (await engine.generate(prompt, params, priority=priority)).token_ids
    tokens: list[int] = []
    stream = engine.stream(prompt, params, priority=priority)
    try:
        async for delta in stream:
            tokens += delta.token_ids
            if len(tokens) >= abort_after:
                break
    finally:
        await stream.aclose()
    return tokens


def _engine_context(rng: random.Random) -> contextlib.AbstractContextManager:
    """Workers that pipeline their steps (the GPU default) in half the draws."""
    return worker_pipeline_on() if rng.random() < 0.5 else contextlib.nullcontext()


@pytest.mark.parametrize("seed", range(4))
async def test_greedy_equals_transformers_under_random_schedules(tiny_llama: str, seed: int) -> None:
    rng = random.Random(seed)
    config, prompts = _config(rng), _prompts(rng)
    prioritised = config.get("scheduling_policy") == "priority"
    with _engine_context(rng):
        async with AsyncEngine(tiny_llama, **config) as engine:
            for wave in range(rng.randint(1, 2)):
                max_tokens = [rng.randint(1, MAX_TOKENS) for _ in prompts]
                aborts = [rng.randint(1, m) if rng.random() < 0.2 else None for m in max_tokens]
                got = await asyncio.gather(*(
                    _greedy(engine, prompt, m, rng.randrange(3) if prioritised else 0, rng.random() * 0.05, abort)
                    for prompt, m, abort in zip(prompts, max_tokens, aborts)))
                for i, (prompt, tokens, m, abort) in enumerate(zip(prompts, got, max_tokens, aborts)):
                    want = _reference(tiny_llama, tuple(prompt))[:m]
                    expected = want if abort is None else want[: len(tokens)]
                    assert tokens == expected, f"seed {seed} {config} wave {wave} request {i} (abort after {abort})"
            await wait_idle(engine)


async def _outputs(engine: AsyncEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))
    return [[completion.token_ids for completion in result.outputs] for result in results]


@pytest.mark.parametrize("seed", range(2))
async def test_seeded_sampling_equals_one_request_at_a_time(tiny_llama: str, seed: int) -> None:
    rng = random.Random(1000 + seed)
    config, prompts = _config(rng), _prompts(rng)
    config.pop("scheduling_policy", None)  # every request at priority 0
    params = [_sampling(rng) for _ in prompts]
    with _engine_context(rng):
        async with AsyncEngine(tiny_llama, **config) as engine:
            got = await _outputs(engine, prompts, params)
            await wait_idle(engine)
    async with AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=MAX_MODEL_LEN, async_scheduling=False,
                           enable_prefix_caching=False, max_num_seqs=1) as alone:
        want = await _outputs(alone, prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"seed {seed} {config} request {i}: {params[i]}"
