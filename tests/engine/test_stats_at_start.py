"""`AsyncEngine.stats()` right after start: the KV cache's size is known from the core's Ready, before its first
snapshot (found by the admission bug hunt, 2026-12-08: num_gpu_blocks read 0 for up to half a second)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio


async def test_stats_name_the_kv_cache_size_as_soon_as_the_engine_started(tiny_llama: str) -> None:
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=256, num_gpu_blocks_override=20)
    async with engine:
        stats = engine.stats()
        assert (stats.num_gpu_blocks, stats.num_used_blocks, stats.kv_cache_usage) == (20, 0, 0.0), stats
        assert stats.num_requests_running == stats.num_requests_waiting == 0


async def test_stats_name_a_restarted_cores_kv_cache_size_before_its_first_snapshot(tiny_llama: str) -> None:
    """A core restart (max_core_restarts) sized anew: stats() names the new core's blocks from its Ready, not the
    dead core's until the new one's first snapshot (its snapshots are held back here to make that window last)."""
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=256, num_gpu_blocks_override=20,
                         max_core_restarts=1)
    async with engine:
        await engine.generate("hi", SamplingParams(max_tokens=2))
        replica = engine._replicas[0]
        assert engine.stats().num_gpu_blocks == 20
        engine.config = engine.config.replace(num_gpu_blocks_override=24)  # the next core's cache (memory freed)
        replica.observer.on_scheduler_stats = lambda stats, reporter: None  # no snapshot of the new core arrives
        os.kill(engine._core.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not replica.supervisor.restarting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await replica.supervisor.wait()
        stats = engine.stats()
        assert stats.engine_alive, stats
        assert (stats.num_gpu_blocks, stats.num_used_blocks, stats.kv_cache_usage) == (24, 0, 0.0), stats
        assert stats.num_requests_running == stats.num_requests_waiting == 0
