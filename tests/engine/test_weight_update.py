"""`AsyncEngine.update_weights` (SGLang's update_weights_from_disk; docs/weight-updates.md) against transformers.

One module-scoped engine, tensor_parallel_size=2 (gloo on the CPU: both ranks check, then both copy), starts on
checkpoint A and goes, in order: refused updates (A still served), an update to B (B's greedy tokens; a prompt
cached under A gets none of A's KV), a killed worker (the workers restart on B), a stream across an update back
to A (its later tokens are A's continuation of everything before), the dev route, then
`update_weights_from_tensors`: a whole state_dict, one sharded part of a fused projection, refused pushes, and a
killed worker after a push (the new workers wait until pushes have written every weight again).
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import pytest_asyncio
import torch

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams, envs
from asyncllm.integrations.openai_server import create_app
from asyncllm.tiny import tiny_checkpoint
from asgi_helpers import asgi_client
from hf_reference import hf_greedy, hf_greedy_with, hf_state_dict
from proc_utils import worker_pids

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPT = list(range(3, 51))  # 48 tokens: 3 full blocks of 16
OTHER = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def checkpoints() -> tuple[str, str]:
    """A and B: the same tiny Llama shapes, different random weights."""
    return tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(checkpoints):
    previous = os.environ.get("ASYNCLLM_WORKER_PIPELINE")
    os.environ["ASYNCLLM_WORKER_PIPELINE"] = "1"  # the workers' pipelined steps too (off on the CPU by default)
    try:
        async with AsyncEngine(checkpoints[0], tensor_parallel_size=2, disable_log_stats=True,
                               max_model_len=256) as engine:
            yield engine
    finally:
        if previous is None:
            os.environ.pop("ASYNCLLM_WORKER_PIPELINE")
        else:
            os.environ["ASYNCLLM_WORKER_PIPELINE"] = previous


async def _greedy(engine: AsyncEngine, prompt: list[int]) -> tuple[list[int], int]:
    """The engine's greedy tokens and the prompt tokens the prefix cache served."""
    before = engine.stats().prefix_cache_hits
    out = await engine.generate(prompt, GREEDY)
    return out.token_ids, engine.stats().prefix_cache_hits - before


async def test_a_checkpoint_that_does_not_fit_is_refused_and_changes_nothing(engine, checkpoints) -> None:
    a = checkpoints[0]
    expected = hf_greedy(a, PROMPT, MAX_TOKENS)
    assert await _greedy(engine, PROMPT) == (expected, 0)
    refused = {
        "/no/such/checkpoint": "is not a folder",
        tiny_checkpoint("llama", hidden_size=128): "hidden_size=128 (served: 64)",
        tiny_checkpoint("qwen2"): "architectures=['Qwen2ForCausalLM'] (served: ['LlamaForCausalLM'])",
    }
    for path, why in refused.items():
        with pytest.raises(InvalidRequestError, match="model_path") as info:
            await engine.update_weights(path)
        assert info.value.field == "model_path" and why in info.value.message
    assert engine.stats().weights_version == 0
    assert await _greedy(engine, PROMPT) == (expected, 32)  # A's KV still cached and served: nothing changed


async def test_an_update_serves_the_new_weights_and_none_of_the_old_kv(engine, checkpoints) -> None:
    b = checkpoints[1]
    assert await engine.update_weights(b) == 1
    assert engine.stats().weights_version == 1
    expected = hf_greedy(b, PROMPT, MAX_TOKENS)
    assert expected != hf_greedy(checkpoints[0], PROMPT, MAX_TOKENS)
    assert await _greedy(engine, PROMPT) == (expected, 0)  # cached under A: computed again with B
    assert await _greedy(engine, PROMPT) == (expected, 32)  # cached under B: served
    assert (await _greedy(engine, OTHER))[0] == hf_greedy(b, OTHER, MAX_TOKENS)


async def test_a_restarted_worker_loads_the_last_update(engine, checkpoints) -> None:
    workers = worker_pids(engine._core.pid)
    os.kill(workers[1], signal.SIGKILL)
    tokens, _ = await _greedy(engine, OTHER)
    assert not set(worker_pids(engine._core.pid)) & set(workers)  # both ranks were replaced
    assert tokens == hf_greedy(checkpoints[1], OTHER, MAX_TOKENS)  # B, not the A the engine started with
    assert engine.stats().weights_version == 1


async def test_a_stream_across_an_update_continues_with_the_new_weights(engine, checkpoints) -> None:
    a, b = checkpoints
    num_tokens = 160  # room for a slow host: the core decodes on while the update is on its way
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    got: list[int] = []
    async for delta in engine.stream(OTHER, params):
        if not got:
            assert await engine.update_weights(a) == 2  # answered after the core collected the step in flight
        got += delta.token_ids
    from_b = hf_greedy(b, OTHER, num_tokens)
    split = next((i for i, (x, y) in enumerate(zip(got, from_b)) if x != y), len(got))  # the first not B's
    assert 1 <= split < num_tokens - 8
    assert got[split:] == hf_greedy(a, OTHER + got[:split], num_tokens - split)  # over the whole prefix, with A


async def test_the_dev_route_updates_and_exists_only_in_dev_mode(engine, checkpoints, monkeypatch) -> None:
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        assert (await client.post("/update_weights_from_disk", json={"model_path": checkpoints[1]})).status_code == 404
    monkeypatch.setenv(envs.SERVER_DEV_MODE.name, "1")
    version = engine.stats().weights_version
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        ok = await client.post("/update_weights_from_disk", json={"model_path": checkpoints[1], "revision": None})
        assert ok.status_code == 200
        assert ok.json() == {"success": True, "weights_version": version + 1,
                             "message": f"weights updated from {checkpoints[1]} (version {version + 1})"}
        bad = await client.post("/update_weights_from_disk", json={"model_path": "/no/such/checkpoint"})
        assert bad.status_code == 400
        assert bad.json()["success"] is False and bad.json()["error"]["param"] == "model_path"
        unknown = await client.post("/update_weights_from_disk", json={"model_path": checkpoints[0], "flush": 1})
        assert unknown.status_code == 400
    assert engine.stats().weights_version == version + 1
    assert (await _greedy(engine, OTHER))[0] == hf_greedy(checkpoints[1], OTHER, MAX_TOKENS)



# ---------------------------------------------------------------- update_weights_from_tensors

def _segments() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"asyncllm-{os.getpid()}-w-")]


async def test_tensors_from_the_host_replace_the_weights_on_both_ranks(engine, checkpoints) -> None:
    a, b = checkpoints
    assert (await _greedy(engine, OTHER))[0] == hf_greedy(b, OTHER, MAX_TOKENS)  # B since the dev route
    version = engine.stats().weights_version
    assert await engine.update_weights_from_tensors(hf_state_dict(a)) == version + 1  # a mapping: state_dict()
    assert await _greedy(engine, PROMPT) == (hf_greedy(a, PROMPT, MAX_TOKENS), 0)  # none of B's KV
    assert not _segments()  # unlinked once answered


async def test_a_subset_of_the_weights_changes_only_those(engine, checkpoints) -> None:
    a, b = checkpoints
    name = "model.layers.0.self_attn.k_proj.weight"  # a part of the fused qkv projection, sharded over the ranks
    bucket = [(name, hf_state_dict(b)[name].to(torch.bfloat16))]  # cast to the served float32 as it is copied
    version = engine.stats().weights_version
    assert await engine.update_weights_from_tensors(bucket) == version + 1
    expected = hf_greedy_with(a, dict(bucket), OTHER, MAX_TOKENS)
    assert expected not in (hf_greedy(a, OTHER, MAX_TOKENS), hf_greedy(b, OTHER, MAX_TOKENS))
    assert (await _greedy(engine, OTHER))[0] == expected
    assert await engine.update_weights_from_tensors(hf_state_dict(a)) == version + 2


@pytest.mark.parametrize("tensors, why", [
    ({"model.layers.0.mlp.nope.weight": torch.zeros(4)}, "unexpected weights: model.layers.0.mlp.nope.weight"),
    ({"model.norm.weight": torch.ones(3)}, "at 'model.norm.weight'"),
    ([("model.norm.weight", torch.ones(64)), ("model.norm.weight", torch.ones(64))], "twice"),
    ({"model.norm.weight": torch.ones(64, dtype=torch.int64)}, "floating-point"),
    ([], "got none"),
    ("model.norm.weight", "got str"),
    ([("model.norm.weight", [1.0] * 64)], "got (str, list)"),
])
async def test_a_push_that_does_not_fit_is_refused_and_changes_nothing(engine, checkpoints, tensors, why) -> None:
    version = engine.stats().weights_version
    with pytest.raises(InvalidRequestError) as info:
        await engine.update_weights_from_tensors(tensors)
    assert info.value.field == "named_tensors" and why in info.value.message
    assert engine.stats().weights_version == version and not _segments()
    assert (await _greedy(engine, OTHER))[0] == hf_greedy(checkpoints[0], OTHER, MAX_TOKENS)


async def test_restarted_workers_wait_until_pushes_write_every_weight_again(engine, checkpoints) -> None:
    a, b = checkpoints
    version = engine.stats().weights_version
    assert await engine.update_weights_from_tensors(hf_state_dict(b)) == version + 1
    workers = worker_pids(engine._core.pid)
    os.kill(workers[0], signal.SIGKILL)  # the pushed weights are on no disk: the new workers start from dummy ones
    task = asyncio.ensure_future(engine.generate(OTHER, GREEDY))
    for _ in range(200):
        await asyncio.sleep(0.05)
        if engine.stats().awaiting_weights:
            break
    assert engine.stats().awaiting_weights and not task.done()
    weights = list(hf_state_dict(b).items())
    assert await engine.update_weights_from_tensors(weights[:5]) == version + 2  # some still unwritten: nothing runs
    await asyncio.sleep(0.3)
    assert engine.stats().awaiting_weights and not task.done()
    assert await engine.update_weights_from_tensors(weights[5:]) == version + 3
    assert (await asyncio.wait_for(task, 60)).token_ids == hf_greedy(b, OTHER, MAX_TOKENS)
    assert not set(worker_pids(engine._core.pid)) & set(workers)


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_a_restarted_core_awaits_pushed_weights(checkpoints) -> None:
    """max_core_restarts: a core that dies after a push comes back awaiting the pushed weights (they died with it),
    at their version. (One that dies after update_weights loads that checkpoint again: the data-parallel test's
    killed replica, tests/engine/test_data_parallel.py.)"""
    a, b = checkpoints
    async with AsyncEngine(a, max_core_restarts=1, disable_log_stats=True, max_model_len=256) as engine:
        assert await engine.update_weights(b) == 1
        assert await engine.update_weights_from_tensors(hf_state_dict(a)) == 2
        os.kill(engine._core.pid, signal.SIGKILL)
        await _until(lambda: not engine.stats().engine_alive)
        await _until(lambda: engine.stats().engine_alive and engine.stats().awaiting_weights)
        task = asyncio.ensure_future(engine.generate(OTHER, GREEDY))
        await asyncio.sleep(0.3)
        assert not task.done() and engine.stats().weights_version == 2
        assert await engine.update_weights_from_tensors(hf_state_dict(a)) == 3
        assert (await asyncio.wait_for(task, 60)).token_ids == hf_greedy(a, OTHER, MAX_TOKENS)


async def test_a_replica_core_dying_during_an_update_comes_back_with_it(checkpoints) -> None:
    """data_parallel_size=2: replica 1's core dies as the update to B reaches it. Replica 0 applied B, so the call
    returns its version and the restarted core loads B (not the update before): both replicas serve B."""
    a, b = checkpoints
    async with AsyncEngine(a, data_parallel_size=2, max_core_restarts=1, disable_log_stats=True,
                           max_model_len=256) as engine:
        assert await engine.update_weights(a) == 1
        replica = engine._replicas[1]
        send = replica.processor.update_weights

        def killed_first(message):  # the core is dead before the update reaches it
            os.kill(replica.core.pid, signal.SIGKILL)
            return send(message)

        replica.processor.update_weights = killed_first
        assert await engine.update_weights(b) == 2
        await _until(lambda: replica.alive and engine.stats().replicas[1].weights_version == 2, 60)
        expected = hf_greedy(b, PROMPT, MAX_TOKENS)
        for rank in (0, 1):
            assert (await engine.generate(PROMPT, GREEDY, data_parallel_rank=rank)).token_ids == expected
