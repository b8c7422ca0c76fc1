"""data_parallel_size=2 on the CPU: two engine cores behind one AsyncEngine (docs/parallelism.md).

One module-scoped engine serves every case: greedy parity with transformers, both replicas used, an abort on
replica 1, reset_prefix_cache on both, requests pinned by data_parallel_rank, weight updates on both, per-engine
Prometheus labels, and last a killed replica core.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, EngineDeadError, SamplingParams
from hf_reference import hf_greedy, hf_state_dict

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
PREFIX = list(range(3, 51))  # 48 tokens: 3 full blocks; a repeat hits 2 (the last prompt token is recomputed)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    engine = AsyncEngine(tiny_llama, data_parallel_size=2, disable_log_stats=True, max_model_len=512,
                         max_core_restarts=1)
    async with engine:
        yield engine


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _hold_replica_0(engine: AsyncEngine):
    """A long stream that runs on replica 0 (both idle: the tie goes to the lowest index) once it decodes."""
    stream = engine.stream([7, 8, 9], LONG)
    await stream.__anext__()
    assert stream.collector.replica == 0
    await _until(lambda: engine.stats().replicas[0].num_requests_running == 1)
    return stream


async def _replica_hits(engine: AsyncEngine, replica: int, prompt: list[int]) -> int:
    before = engine.stats().replicas[replica].prefix_cache_hits
    stream = engine.stream(prompt, GREEDY)
    async for _ in stream:
        pass
    assert stream.collector.replica == replica
    await _until(lambda: engine.stats().replicas[replica].num_requests_running == 0)
    return engine.stats().replicas[replica].prefix_cache_hits - before


async def test_greedy_batch_equals_transformers_on_both_replicas(engine: AsyncEngine) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    before = engine.stats()
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts),
                                engine.generate(prompts[0], SamplingParams(n=2, temperature=0.0, max_tokens=4)))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(engine.config.model, prompt, MAX_TOKENS)
    assert [o.token_ids for o in outs[-1].outputs] == [hf_greedy(engine.config.model, prompts[0], 4)] * 2
    after = engine.stats()
    assert len(after.replicas) == 2
    served = [a.prompt_tokens_total - b.prompt_tokens_total for a, b in zip(after.replicas, before.replicas)]
    assert all(n > 0 for n in served), served  # both replicas ran requests
    assert sum(served) == after.prompt_tokens_total - before.prompt_tokens_total
    assert sum(served) == sum(map(len, prompts)) + 2 * len(prompts[0])  # the n=2 request: once per sample
    assert after.num_gpu_blocks == sum(r.num_gpu_blocks for r in after.replicas) > 0


async def test_abort_on_replica_1_frees_its_blocks_and_replica_0_runs_on(engine: AsyncEngine) -> None:
    held = await _hold_replica_0(engine)
    aborts = engine.stats().replicas[1].request_success_total["abort"]
    stream = engine.stream([11, 12, 13, 14], LONG)
    await stream.__anext__()
    assert stream.collector.replica == 1  # replica 0 is busy
    await _until(lambda: engine.stats().replicas[1].num_used_blocks > 0)
    await stream.aclose()
    await _until(lambda: engine.stats().replicas[1].num_used_blocks == 0)
    s = engine.stats()
    assert (s.replicas[1].num_requests_running, s.replicas[1].num_requests_waiting) == (0, 0)
    assert s.replicas[1].request_success_total["abort"] == aborts + 1
    assert s.replicas[0].num_requests_running == 1 and s.replicas[0].num_used_blocks > 0
    await held.aclose()
    await _until(lambda: engine.stats().num_used_blocks == 0)


async def test_reset_prefix_cache_reaches_both_replicas(engine: AsyncEngine) -> None:
    held = await _hold_replica_0(engine)
    await _replica_hits(engine, 1, PREFIX)
    assert await _replica_hits(engine, 1, PREFIX) == 32
    await held.aclose()
    await _until(lambda: engine.stats().num_used_blocks == 0)
    await _replica_hits(engine, 0, PREFIX)
    assert await _replica_hits(engine, 0, PREFIX) == 32
    assert await engine.reset_prefix_cache() is True
    assert await _replica_hits(engine, 0, PREFIX) == 0
    held = await _hold_replica_0(engine)
    assert await _replica_hits(engine, 1, PREFIX) == 0
    await held.aclose()


async def test_data_parallel_rank_pins_a_request_to_its_replica(engine: AsyncEngine) -> None:
    """vLLM's data_parallel_rank: the named replica runs the request even when the other one is idle (the balancer
    alone would pick replica 0 for both); the OpenAI server takes it from the X-data-parallel-rank header."""
    from asgi_helpers import asgi_client
    from asyncllm import InvalidRequestError
    from asyncllm.integrations.openai_server import create_app

    for rank in (1, 1, 0):
        stream = engine.stream(PREFIX, GREEDY, data_parallel_rank=rank)
        tokens = [t async for delta in stream for t in delta.token_ids]
        assert stream.collector.replica == rank and tokens == hf_greedy(engine.config.model, PREFIX, MAX_TOKENS)
    for rank in (2, -1, True, "1"):
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate(PREFIX, GREEDY, data_parallel_rank=rank)
        assert info.value.field == "data_parallel_rank"
    before = [r.prompt_tokens_total for r in engine.stats().replicas]
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        body = {"model": engine.config.model, "prompt": PREFIX, "max_tokens": 2}
        ok = await client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "1"})
        bad = await client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "one"})
    assert ok.status_code == 200 and bad.status_code == 400 and "X-data-parallel-rank" in bad.text
    await _until(lambda: engine.stats().replicas[1].prompt_tokens_total == before[1] + len(PREFIX))
    assert engine.stats().replicas[0].prompt_tokens_total == before[0]


async def test_refused_requests_do_not_steer_the_balancer(engine: AsyncEngine) -> None:
    """Refused on the processor thread, they never reach the core (no snapshot follows): each stops counting on its
    replica when it fails, so after a burst of them an idle engine still sends the next request to replica 0."""
    from asyncllm import InvalidRequestError

    await _until(lambda: all(r.num_requests_running + r.num_requests_waiting == 0 for r in engine.stats().replicas))
    for bad in ([5] * 600, [10**6], [5] * 600):  # past max_model_len, out of vocab
        stream = engine.stream(bad, GREEDY)
        with pytest.raises(InvalidRequestError):
            await stream.__anext__()
        assert stream.collector.replica == 0
    stream = engine.stream([5, 6], GREEDY)
    assert len([t async for delta in stream for t in delta.token_ids]) == MAX_TOKENS and stream.collector.replica == 0


async def test_update_weights_reaches_both_replicas(engine: AsyncEngine, tiny_llama: str) -> None:
    """docs/weight-updates.md: every replica loads the new weights before `update_weights` returns."""
    from asyncllm.tiny import tiny_checkpoint

    other = tiny_checkpoint("llama", seed=1)
    assert await engine.update_weights(other) == 1
    assert [s.weights_version for s in engine.stats().replicas] == [1, 1]
    expected = hf_greedy(other, PREFIX, MAX_TOKENS)
    held = await _hold_replica_0(engine)
    on_replica_1 = engine.stream(PREFIX, GREEDY)
    tokens = [t async for delta in on_replica_1 for t in delta.token_ids]
    assert on_replica_1.collector.replica == 1 and tokens == expected
    await held.aclose()
    assert (await engine.generate(PREFIX, GREEDY)).token_ids == expected
    # back to the engine's own model, pushed from memory (one segment, both replicas), then from its folder: the
    # tests below expect it, and a restarted replica loads that checkpoint again
    assert await engine.update_weights_from_tensors(hf_state_dict(tiny_llama)) == 2
    assert [s.weights_version for s in engine.stats().replicas] == [2, 2]
    assert (await engine.generate(PREFIX, GREEDY)).token_ids == hf_greedy(tiny_llama, PREFIX, MAX_TOKENS)
    assert await engine.update_weights(tiny_llama) == 3


async def test_every_series_carries_the_engine_label_of_its_replica(engine: AsyncEngine) -> None:
    registry, model = engine.metrics_registry, engine._observer.stats.model_name

    def every_replica_reported() -> bool:  # run alone, replica 1's first snapshot may not have come yet
        running = [registry.get_sample_value("asyncllm:num_requests_running", {"model_name": model, "engine": str(i)})
                   for i in range(engine.config.data_parallel_size)]
        return running == [0] * len(running) and engine.stats().num_used_blocks == 0

    await _until(every_replica_reported)
    s = engine.stats()
    for index, replica in enumerate(s.replicas):
        labels = {"model_name": model, "engine": str(index)}
        assert registry.get_sample_value("asyncllm:num_requests_running", labels) == 0
        assert registry.get_sample_value("asyncllm:prefix_cache_hits_total", labels) == replica.prefix_cache_hits
        assert registry.get_sample_value("asyncllm:prompt_tokens_total", labels) == replica.prompt_tokens_total
    assert registry.get_sample_value("asyncllm:num_requests_running", {"model_name": model}) is None
    assert s.prompt_tokens_total == sum(replica.prompt_tokens_total for replica in s.replicas)


async def test_a_killed_replica_fails_only_its_requests_and_is_restarted(engine: AsyncEngine) -> None:
    held = await _hold_replica_0(engine)
    doomed = engine.stream([21, 22, 23], LONG)
    await doomed.__anext__()
    assert doomed.collector.replica == 1
    core = engine._replicas[1].core
    os.kill(core.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        async for _ in doomed:
            pass
    assert engine.stats().engine_alive  # replica 0 serves on
    out = await engine.generate(PREFIX, GREEDY)  # replica 1 is dead or restarting: replica 0 takes it
    assert out.token_ids == hf_greedy(engine.config.model, PREFIX, MAX_TOKENS)
    got = [delta async for delta in _take(held, 3)]
    assert len(got) == 3 and held.collector.replica == 0 and not held.collector.finished
    await held.aclose()
    await _until(lambda: engine.stats().replicas[1].engine_alive, timeout=30)  # the supervisor restarted it
    assert engine._replicas[1].core.pid != core.pid
    await _until(lambda: engine.stats().replicas[1].weights_version == 3)  # the last update, replayed
    held = await _hold_replica_0(engine)
    stream = engine.stream(PREFIX, GREEDY)
    tokens = [t async for delta in stream for t in delta.token_ids]
    assert stream.collector.replica == 1 and tokens == out.token_ids  # the new core serves
    await held.aclose()


async def _take(stream, n: int):
    async for delta in stream:
        yield delta
        n -= 1
        if n == 0:
            return
