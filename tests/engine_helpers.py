"""Helpers shared by the engine tests."""

from __future__ import annotations

import asyncio
import time

from asyncllm import AsyncEngine


async def wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> None:
    """Wait until the core reports nothing running or waiting and no KV block in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_requests_running == 0 and s.num_requests_waiting == 0 and s.num_used_blocks == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {engine.stats()}")
