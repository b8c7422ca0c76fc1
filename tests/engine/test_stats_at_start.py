"""`AsyncEngine.stats()` right after start: the KV cache's size is known from the core's Ready, before its first
snapshot (found by the admission bug hunt, 2026-12-08: num_gpu_blocks read 0 for up to half a second)."""

from __future__ import annotations

import pytest

from asyncllm import AsyncEngine

pytestmark = pytest.mark.asyncio


async def test_stats_name_the_kv_cache_size_as_soon_as_the_engine_started(tiny_llama: str) -> None:
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=256, num_gpu_blocks_override=20)
    async with engine:
        stats = engine.stats()
        assert (stats.num_gpu_blocks, stats.num_used_blocks, stats.kv_cache_usage) == (20, 0, 0.0), stats
        assert stats.num_requests_running == stats.num_requests_waiting == 0
