"""Overlapped scheduling (async_scheduling=True) on a real engine: the core schedules step N+1 while the worker
process computes step N, and every output stays what the synchronous engine gives.

Greedy outputs equal transformers' under every batch shape, chunked prefill, preemption (recompute and swap),
tensor parallelism and prefix hits; max_tokens=1, EOS and stop_token_ids end requests mid-batch at the right
token (the token already scheduled after it is dropped); seeded sampling, penalties and logprobs equal the
synchronous engine's; aborts mid-stream leak no block; structured-output requests run (synchronous steps);
a worker killed or hung with steps in flight: tests/engine/test_faults.py (parametrized over the mode).
"""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, SamplingParams
from engine_helpers import random_prompts, snapshot_before_first_output, wait_idle, worker_pipeline_on
from hf_reference import hf_greedy

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 24
EOS = 1
"""The tiny tokenizer's EOS id."""
BYTES_PER_BLOCK = 8192
"""The tiny Llama's KV block: 2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes."""
ENGINE = dict(disable_log_stats=True, async_scheduling=True)


_REFERENCES: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _reference(path: str, prompt: list[int]) -> list[int]:
    key = (path, tuple(prompt))
    if key not in _REFERENCES:
        _REFERENCES[key] = hf_greedy(path, prompt, MAX_TOKENS)
    return _REFERENCES[key]


async def _greedy(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [o.token_ids for o in outs]


def _check(path: str, prompts: list[list[int]], got: list[list[int]]) -> None:
    for prompt, tokens in zip(prompts, got):
        assert tokens == _reference(path, prompt), f"prompt of {len(prompt)} tokens diverged"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    """The async engine, its workers pipelining their steps as on a GPU (docs/scheduling.md)."""
    engine = AsyncEngine(tiny_llama, max_model_len=256, max_num_batched_tokens=64, **ENGINE)
    with worker_pipeline_on():
        await engine.start()
    try:
        yield engine
    finally:
        await engine.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sync_engine(tiny_llama: str):
    async with AsyncEngine(tiny_llama, disable_log_stats=True, async_scheduling=False, max_model_len=256, max_num_batched_tokens=64) as engine:
        yield engine


# ------------------------------------------------------------------ greedy parity with transformers
CASES = {
    "default": {},
    "chunked-tiny-batches": {"max_num_batched_tokens": 16, "max_num_seqs": 3, "block_size": 8},
    "preempt-recompute": {"num_gpu_blocks_override": 12, "max_model_len": 128},
    "preempt-swap": {"num_gpu_blocks_override": 12, "max_model_len": 128, "preemption_mode": "swap",
                     "swap_space": 4 * BYTES_PER_BLOCK / 2**30},
    "priority-tp2": {"num_gpu_blocks_override": 12, "max_model_len": 128, "scheduling_policy": "priority",
                     "tensor_parallel_size": 2, "max_num_batched_tokens": 24},
}


@pytest.mark.parametrize("case", list(CASES))
async def test_greedy_parity_with_transformers(tiny_llama: str, case: str) -> None:
    prompts = random_prompts(14, seed=0)
    engine = AsyncEngine(tiny_llama, **ENGINE, **CASES[case])
    with worker_pipeline_on():  # the workers read it at their start
        await engine.start()
    async with engine:  # started already: closes it
        prioritised = CASES[case].get("scheduling_policy") == "priority"  # fcfs refuses a priority it would ignore
        priorities = [random.Random(i).randrange(3) if prioritised else 0 for i in range(len(prompts))]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = await asyncio.gather(*(engine.generate(p, params, priority=k) for p, k in zip(prompts, priorities)))
        await wait_idle(engine)
        stats = engine.stats()
    _check(tiny_llama, prompts, [o.token_ids for o in outs])
    if case.startswith("preempt") or case == "priority-tp2":
        assert stats.num_preemptions_total > 0
    if case == "preempt-swap":
        assert stats.num_swapped_total > 0


async def test_prefix_hits_keep_greedy_parity(engine: AsyncEngine, tiny_llama: str) -> None:
    prompts = random_prompts(8, seed=4, stem_len=48, max_len=80)
    first = await _greedy(engine, prompts)
    before = engine.stats().prefix_cache_hits
    second = await _greedy(engine, prompts)
    assert engine.stats().prefix_cache_hits - before >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert second == first
    _check(tiny_llama, prompts, first)
    await wait_idle(engine)


async def test_max_tokens_one_beside_long_requests(engine: AsyncEngine, tiny_llama: str) -> None:
    prompts = random_prompts(10, seed=5)
    lengths = [1, MAX_TOKENS, 1, 2, MAX_TOKENS, 1, 3, MAX_TOKENS, 1, 1]
    outs = await asyncio.gather(*(engine.generate(p, SamplingParams(temperature=0.0, max_tokens=n))
                                  for p, n in zip(prompts, lengths)))
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == _reference(tiny_llama, prompt)[:n]
        assert out.outputs[0].finish_reason == "length"
    await wait_idle(engine)


# ------------------------------------------------------------------ stops mid-batch
async def test_stop_token_ids_end_requests_mid_batch(engine: AsyncEngine, tiny_llama: str) -> None:
    """Each request stops at a different step on one of its own greedy tokens; the others run on."""
    prompts = random_prompts(8, seed=6)
    jobs = []
    for i, prompt in enumerate(prompts):
        ref = _reference(tiny_llama, prompt)
        stop = ref[(3 * i) % (MAX_TOKENS - 4)] if i % 2 else None
        jobs.append((prompt, ref, stop))
    outs = await asyncio.gather(*(
        engine.generate(p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[s] if s else []))
        for p, _, s in jobs))
    for (prompt, ref, stop), out in zip(jobs, outs):
        completion = out.outputs[0]
        if stop is None:
            assert out.token_ids == ref and completion.finish_reason == "length"
        else:
            assert out.token_ids == ref[: ref.index(stop) + 1]
            assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    await wait_idle(engine)


async def test_eos_ends_requests_mid_batch(engine: AsyncEngine, tiny_llama: str) -> None:
    """min_tokens holds EOS back for k tokens, a logit bias then makes it the next one: a stop at token k + 1."""
    prompts = random_prompts(6, seed=7)
    stops = [2, None, 5, 1, None, 9]

    def params(k: int | None) -> SamplingParams:
        if k is None:
            return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=k, logit_bias={EOS: 100.0})

    outs = await asyncio.gather(*(engine.generate(p, params(k)) for p, k in zip(prompts, stops)))
    for prompt, k, out in zip(prompts, stops, outs):
        ref = _reference(tiny_llama, prompt)
        if k is None:
            assert out.token_ids == ref
        else:
            assert out.token_ids == ref[:k] + [EOS] and out.outputs[0].finish_reason == "stop"
    await wait_idle(engine)


# ------------------------------------------------------------------ equal to the synchronous engine
SAMPLING = {
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=11, max_tokens=16, ignore_eos=True, n=2),
    "penalties": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                                frequency_penalty=0.4, presence_penalty=0.3, logit_bias={10: 1.5}),
    "seeded-penalties": SamplingParams(temperature=0.8, min_p=0.05, seed=5, max_tokens=16, ignore_eos=True,
                                       frequency_penalty=0.6, presence_penalty=0.5, min_tokens=4),
    "logprobs": SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2),
    "token-masks": SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True,
                                  allowed_token_ids=list(range(8, 120)), bad_words_token_ids=[[20, 21], [22]]),
}


@pytest.mark.parametrize("kind", list(SAMPLING))
async def test_sampling_equals_the_synchronous_engine(engine: AsyncEngine, sync_engine: AsyncEngine, kind: str) -> None:
    prompts = random_prompts(6, seed=8)
    base = SAMPLING[kind]
    variants = [SamplingParams(**{**_fields(base), "seed": base.seed + i}) if base.seed is not None else base
                for i in range(len(prompts))]

    async def run(e: AsyncEngine) -> list:
        return await asyncio.gather(*(e.generate(p, v) for p, v in zip(prompts, variants)))

    got, want = await run(engine), await run(sync_engine)
    for a, b in zip(got, want):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        for x, y in zip(a.outputs, b.outputs):
            _same_logprobs(x.logprobs, y.logprobs)
        _same_logprobs(a.prompt_logprobs, b.prompt_logprobs)
    if kind == "seeded":
        assert len({tuple(o.token_ids) for out in got for o in out.outputs}) > 1  # really sampled
    if kind == "logprobs":
        assert got[0].outputs[0].logprobs and got[0].prompt_logprobs
    await wait_idle(engine)


def _same_logprobs(got: list | None, want: list | None) -> None:
    """The same tokens and ranks at every position; values equal up to float noise of other batch shapes."""
    assert (got is None) == (want is None)
    for x, y in zip(got or [], want or []):
        assert (x is None) == (y is None)
        if x is not None:
            assert list(x) == list(y) and [v.rank for v in x.values()] == [v.rank for v in y.values()]
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-5)
    assert len(got or []) == len(want or [])


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


# ------------------------------------------------------------------ aborts
async def test_aborts_mid_stream_leak_no_block(engine: AsyncEngine, tiny_llama: str) -> None:
    prompts = random_prompts(10, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    async def consume(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in engine.stream(prompt, params):
            tokens += delta.token_ids
            if i % 2 and len(tokens) >= i // 2 + 1:
                break  # leaves the stream: the request is aborted with steps in flight
        return tokens

    got = await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))
    for i, (prompt, tokens) in enumerate(zip(prompts, got)):
        ref = _reference(tiny_llama, prompt)
        assert tokens == (ref[: len(tokens)] if i % 2 else ref)
        assert i % 2 == 0 or len(tokens) < MAX_TOKENS
    await wait_idle(engine)
    assert engine.stats().num_used_blocks == 0
    assert await _greedy(engine, prompts[:2]) == [_reference(tiny_llama, p) for p in prompts[:2]]


# ------------------------------------------------------------------ stats snapshots
async def test_a_step_that_admits_a_request_shows_it_running_before_its_output(engine: AsyncEngine,
                                                                               sync_engine: AsyncEngine) -> None:
    """Both modes send a fresh snapshot when a step that admits a request is submitted (overlapped) or about to run
    (synchronous): during a long first step the hosts never see the request as waiting, or not at all."""
    for each in (engine, sync_engine):
        assert await snapshot_before_first_output(each, [5, 6, 7, 8]) == (1, 0)


# ------------------------------------------------------------------ structured output: synchronous steps
async def test_structured_requests_run_beside_overlapped_ones(engine: AsyncEngine, tiny_llama: str) -> None:
    pytest.importorskip("xgrammar")
    from asyncllm import StructuredOutputs

    prompts = random_prompts(4, seed=10)
    regex = SamplingParams(n=3, seed=3, max_tokens=30, structured=StructuredOutputs(regex=r"[a-z]{3}-\d{2}"))
    plain_before = asyncio.gather(*(engine.generate(p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
                                    for p in prompts))
    structured = await engine.generate("id:", regex)
    plain = await plain_before
    assert all(re.fullmatch(r"[a-z]{3}-\d{2}", o.text) and o.finish_reason == "stop" for o in structured.outputs)
    _check(tiny_llama, prompts, [o.token_ids for o in plain])
    await wait_idle(engine)
