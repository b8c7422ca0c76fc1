"""`AsyncEngine.sleep` / `wake_up` (vLLM's sleep mode; docs/sleep-mode.md) against transformers.

One module-scoped engine, tensor_parallel_size=1, enable_sleep_mode=True, starts on checkpoint A and goes, in
order: sleep(1) and wake_up (A's tokens, none of the old prefix cache), a request sent while asleep (it waits,
then runs), a stream across a sleep (recomputed: A's tokens throughout), an update while asleep at level 1 (the
CPU copy), the RL cycle sleep(2) -> wake_up(["weights"]) -> update_weights(B) -> wake_up(["kv_cache"]) (B's
tokens), a full wake-up after level 2 with no update (nothing runs until one), the same with
`update_weights_from_tensors` in two buckets (nothing runs until both wrote), and the dev routes.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams, envs
from asyncllm.integrations.openai_server import create_app
from asyncllm.tiny import tiny_checkpoint
from asgi_helpers import asgi_client
from hf_reference import hf_greedy, hf_state_dict

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPT = list(range(3, 51))  # 48 tokens: 3 full blocks of 16
OTHER = [11, 12, 13, 14, 15, 16, 17]
_HELD_S = 0.3
"""How long a request must stay unserved to count as held (the core steps every few milliseconds)."""


@pytest.fixture(scope="module")
def checkpoints() -> tuple[str, str]:
    """A and B: the same tiny Llama shapes, different random weights."""
    return tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(checkpoints):
    async with AsyncEngine(checkpoints[0], enable_sleep_mode=True, disable_log_stats=True,
                           max_model_len=256, num_gpu_blocks_override=64) as engine:  # small: quick to reallocate
        yield engine


async def _greedy(engine: AsyncEngine, prompt: list[int]) -> tuple[list[int], int]:
    """The engine's greedy tokens and the prompt tokens the prefix cache served."""
    before = engine.stats().prefix_cache_hits
    out = await engine.generate(prompt, GREEDY)
    return out.token_ids, engine.stats().prefix_cache_hits - before


async def _held(engine: AsyncEngine, prompt: list[int]) -> asyncio.Task:
    """A request submitted now, checked to be waiting and unserved for a while."""
    task = asyncio.ensure_future(engine.generate(prompt, GREEDY))
    await asyncio.sleep(_HELD_S)
    assert not task.done() and engine.stats().num_requests_waiting == 1
    return task


async def test_sleep_and_wake_up_serve_the_same_tokens_and_none_of_the_old_kv(engine, checkpoints) -> None:
    expected = hf_greedy(checkpoints[0], PROMPT, MAX_TOKENS)
    assert await _greedy(engine, PROMPT) == (expected, 0)
    assert await _greedy(engine, PROMPT) == (expected, 32)  # cached
    assert await engine.is_sleeping() is False
    await engine.sleep(level=1)
    assert await engine.is_sleeping() is True and engine.stats().sleep_level == 1
    await engine.wake_up()
    assert await engine.is_sleeping() is False and engine.stats().sleep_level == 0
    assert await _greedy(engine, PROMPT) == (expected, 0)  # the KV was discarded: no hit


async def test_a_request_sent_while_asleep_runs_after_wake_up_and_timeouts_count(engine, checkpoints) -> None:
    await engine.sleep(1)
    timed = await engine.generate(PROMPT, GREEDY, timeout=0.1)  # ends while asleep: its timeout still counts
    assert timed.finish_reason == "timeout" and timed.token_ids == []
    task = await _held(engine, OTHER)
    await engine.wake_up()
    assert (await task).token_ids == hf_greedy(checkpoints[0], OTHER, MAX_TOKENS)


async def test_a_stream_across_a_sleep_is_recomputed(engine, checkpoints) -> None:
    num_tokens = 40
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    got: list[int] = []
    async for delta in engine.stream(OTHER, params):
        if not got:
            await engine.sleep(1)  # the core collects the step in flight, then drops the request's KV
            await engine.wake_up()
        got += delta.token_ids
    assert got == hf_greedy(checkpoints[0], OTHER, num_tokens)  # not recomputed: decoded over a zeroed KV cache


async def test_an_update_while_asleep_at_level_1_updates_the_cpu_copy(engine, checkpoints) -> None:
    a, b = checkpoints
    await engine.sleep(1)
    assert await engine.update_weights(b) == 1
    await engine.wake_up()
    assert (await _greedy(engine, OTHER))[0] == hf_greedy(b, OTHER, MAX_TOKENS)
    assert await engine.update_weights(a) == 2


async def test_level_2_weights_then_an_update_then_the_kv_cache(engine, checkpoints) -> None:
    b = checkpoints[1]
    await engine.sleep(level=2)
    with pytest.raises(InvalidRequestError, match="wake_up") as info:  # nothing to copy into
        await engine.update_weights(b)
    assert info.value.field == "model_path"
    await engine.wake_up(tags=["weights"])
    stats = engine.stats()
    assert (stats.is_sleeping, stats.sleep_level, stats.awaiting_weights) == (True, 2, True)  # the KV still sleeps
    assert await engine.update_weights(b) == 3
    assert engine.stats().awaiting_weights is False
    await engine.wake_up(tags=["kv_cache"])
    assert await engine.is_sleeping() is False
    expected = hf_greedy(b, PROMPT, MAX_TOKENS)
    assert await _greedy(engine, PROMPT) == (expected, 0)


async def test_a_full_wake_up_after_level_2_runs_nothing_until_an_update(engine, checkpoints) -> None:
    a = checkpoints[0]
    await engine.sleep(2)
    await engine.wake_up()
    assert await engine.is_sleeping() is False and engine.stats().awaiting_weights is True
    task = await _held(engine, OTHER)  # uninitialised weights never generate
    assert await engine.update_weights(a) == 4
    assert (await task).token_ids == hf_greedy(a, OTHER, MAX_TOKENS)


async def test_after_level_2_pushed_buckets_run_nothing_until_every_weight_is_written(engine, checkpoints) -> None:
    b = checkpoints[1]
    await engine.sleep(2)
    await engine.wake_up()
    task = await _held(engine, OTHER)
    buckets = list(hf_state_dict(b).items())
    version = engine.stats().weights_version
    assert await engine.update_weights_from_tensors(buckets[::2]) == version + 1
    await asyncio.sleep(_HELD_S)
    assert engine.stats().awaiting_weights and not task.done()  # half the weights are still uninitialised
    assert await engine.update_weights_from_tensors(buckets[1::2]) == version + 2
    assert (await task).token_ids == hf_greedy(b, OTHER, MAX_TOKENS)


async def test_the_dev_routes_exist_only_in_dev_mode(engine, monkeypatch) -> None:
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        assert (await client.post("/sleep?level=1")).status_code == 404
        assert (await client.get("/is_sleeping")).status_code == 404
    monkeypatch.setenv(envs.SERVER_DEV_MODE.name, "1")
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        assert (await client.post("/sleep?level=1")).status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert (await client.post("/wake_up?tags=weights")).status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}  # the KV cache still sleeps
        assert (await client.post("/wake_up?tags=kv_cache")).status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        bad = await client.post("/sleep?level=3")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
        bad = await client.post("/wake_up?tags=optimizer")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
