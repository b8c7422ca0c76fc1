"""Faults on a real engine: a worker killed or hung mid-generation, workers that keep failing, a killed core.

A worker fault is recovered inside the core (new workers, running requests
recomputed): streams continue token-exact. A core fault fails every open
stream with EngineDeadError within a second; the supervisor (max_core_restarts)
then serves new requests on a new core.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from transformers import AutoTokenizer

from asyncllm import AsyncEngine, EngineDeadError, SamplingParams
from hf_reference import hf_greedy
from proc_utils import worker_pids
from engine_helpers import wait_idle as _wait_idle

PROMPTS = ["def main():", "import os\n", "class Config:"]
MAX_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_KWARGS = dict(disable_log_stats=True, max_model_len=256, num_gpu_blocks_override=64)
SPAWN_PROCESSES = True  # checks workers' command lines and which processes follow a killed core: new interpreters, not the test fork server (tests/conftest.py)


class Streams:
    """Consume one greedy stream per prompt in the background, recording tokens and how each ended."""

    def __init__(self, engine: AsyncEngine, prompts: list[str]) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[tuple[BaseException, float] | None] = [None for _ in prompts]
        self.finish: list[str | None] = [None for _ in prompts]
        self.tasks = [asyncio.create_task(self._consume(engine, i, p)) for i, p in enumerate(prompts)]

    async def _consume(self, engine: AsyncEngine, index: int, prompt: str) -> None:
        try:
            async for delta in engine.stream(prompt, GREEDY):
                self.tokens[index] += delta.token_ids
                self.finish[index] = delta.finish_reason
        except EngineDeadError as exc:
            self.errors[index] = (exc, time.monotonic())

    async def wait_for_tokens(self, at_least: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while min(len(t) for t in self.tokens) < at_least:
            assert time.monotonic() < deadline, f"streams too slow: {[len(t) for t in self.tokens]}"
            await asyncio.sleep(0.005)

    async def join(self, timeout: float = 120.0) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout)


@pytest.fixture(scope="module")
def expected(tiny_llama: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return [hf_greedy(tiny_llama, tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize(("async_scheduling", "pipeline", "faults"),
                         [(False, "auto", (signal.SIGKILL,)),  # the hang (watchdog) path: once, with the most in flight
                          (True, "1", (signal.SIGKILL, signal.SIGSTOP))],
                         ids=["sync", "async-pipelined"])
async def test_worker_killed_or_hung_mid_generation_streams_stay_exact(tiny_llama: str, expected,
                                                                      async_scheduling: bool, pipeline: str,
                                                                      faults: tuple[signal.Signals, ...],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With async_scheduling, two steps may be in flight when the worker dies: both are recomputed.

    "async-pipelined": the workers (restarted ones too) also launch a step before sending the last one (the
    most steps in flight; the core's overlap and the workers' pipeline are tested together, "sync" has neither).
    """
    monkeypatch.setenv("ASYNCLLM_WORKER_PIPELINE", pipeline)  # the core passes it on to every worker it starts
    engine = AsyncEngine(tiny_llama, worker_step_timeout_s=2.0, async_scheduling=async_scheduling, **ENGINE_KWARGS)
    async with engine:
        for fault in faults:  # dead, then hung past the watchdog
            [worker] = worker_pids(engine._core.pid)
            streams = Streams(engine, PROMPTS)
            await streams.wait_for_tokens(5)
            os.kill(worker, fault)
            assert streams.finish == [None] * 3  # the fault hit mid-generation
            await streams.join()
            assert streams.errors == [None, None, None], fault
            assert streams.finish == ["length"] * 3
            assert streams.tokens == expected, fault  # nothing lost, nothing repeated, greedy unchanged
            [new_worker] = worker_pids(engine._core.pid)
            assert new_worker != worker
            with open(f"/proc/{new_worker}/cmdline", "rb") as f:  # the host's config: no config.json read again
                assert b"--hf-config-json" in f.read().split(b"\0")
            await _wait_idle(engine)
            assert engine.stats().engine_alive
        out = await engine.generate(PROMPTS[0], GREEDY)
        assert out.token_ids == expected[0]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
async def test_workers_failing_past_max_worker_restarts_fail_every_stream(tiny_llama: str,
                                                                          tensor_parallel_size: int) -> None:
    """The killed rank is named, with TP too (its partner's broken collective reports first: not blamed)."""
    engine = AsyncEngine(tiny_llama, max_worker_restarts=0, tensor_parallel_size=tensor_parallel_size,
                         **ENGINE_KWARGS)
    async with engine:
        await engine.check_health()  # vLLM's health and state calls (asyncllm/engine/engine_state.py)
        assert engine.is_running and not engine.errored and not engine.is_stopped
        assert await engine.get_supported_tasks() == ("generate", "embed", "token_embed")
        worker = worker_pids(engine._core.pid)[-1]
        streams = Streams(engine, PROMPTS)
        await streams.wait_for_tokens(3)
        os.kill(worker, signal.SIGKILL)
        await streams.join(timeout=10)
        assert all(error is not None for error in streams.errors), streams.errors
        assert "max_worker_restarts=0" in str(streams.errors[0][0])
        assert f"(pid {worker}) was killed by SIGKILL" in str(streams.errors[0][0]), streams.errors[0][0]
        assert not engine.stats().engine_alive
        with pytest.raises(EngineDeadError):
            await engine.generate(PROMPTS[0], GREEDY)
        assert engine.errored and not engine.is_running and not engine.is_stopped
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await engine.check_health()
    assert engine.is_stopped and engine.errored and "closed" in str(engine.dead_error)


async def test_killed_core_fails_streams_within_a_second_and_the_supervisor_restarts_it(tiny_llama: str,
                                                                                          expected) -> None:
    """A core stopped for seconds (SIGSTOP: every thread of it starved, as on an overloaded machine) is not dead;
    a killed one fails the streams at once with an error naming the signal."""
    engine = AsyncEngine(tiny_llama, max_core_restarts=1, **ENGINE_KWARGS)
    async with engine:
        core_pid = engine._core.pid
        [worker] = worker_pids(core_pid)
        streams = Streams(engine, PROMPTS)
        await streams.wait_for_tokens(3)
        os.kill(core_pid, signal.SIGSTOP)
        assert streams.finish == [None] * 3  # stopped mid-generation
        await asyncio.sleep(2.0)  # twice the 1 s heartbeat timeout that once declared such a core dead
        os.kill(core_pid, signal.SIGCONT)
        await streams.join()
        assert streams.errors == [None, None, None] and streams.tokens == expected
        assert engine.stats().engine_alive and engine._core.pid == core_pid

        streams = Streams(engine, PROMPTS)
        await streams.wait_for_tokens(3)
        killed_at = time.monotonic()
        os.kill(core_pid, signal.SIGKILL)
        await streams.join(timeout=10)
        assert all(error is not None for error in streams.errors), streams.errors
        latencies = [at - killed_at for _, at in streams.errors]  # type: ignore[misc]
        assert max(latencies) < 1.0, latencies
        assert f"engine core (pid {core_pid}) was killed by SIGKILL" in str(streams.errors[0][0])  # type: ignore[index]
        assert not engine.stats().engine_alive  # until the new core serves
        assert not engine.errored and not engine.is_running  # restarting: requests wait for the new core

        out = await engine.generate(PROMPTS[1], GREEDY)  # waits for the restart, then runs on the new core
        assert out.token_ids == expected[1]
        assert engine._core.pid != core_pid and engine.stats().engine_alive
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:  # the old worker followed its core
            await asyncio.sleep(0.05)
        assert not os.path.exists(f"/proc/{worker}")
