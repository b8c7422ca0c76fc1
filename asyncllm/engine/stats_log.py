"""The periodic stats log line, in the spirit of vLLM's."""

from __future__ import annotations

import logging
import time

from asyncllm.protocol import SchedulerStats

logger = logging.getLogger("asyncllm.engine.stats")


class StatsLogger:
    """Logs one line every `interval_s` while the engine is busy (or just was)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._latest = SchedulerStats()
        self._last = SchedulerStats()
        self._last_time = time.monotonic()

    def record(self, stats: SchedulerStats) -> None:
        self._latest = stats

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_time < self.interval_s:
            return
        line = self.format_line(self._last, self._latest, now - self._last_time)
        if line is not None:
            logger.info(line)
        self._last, self._last_time = self._latest, now

    @staticmethod
    def format_line(prev: SchedulerStats, cur: SchedulerStats, elapsed_s: float) -> str | None:
        """None when nothing happened since `prev` and nothing is in flight."""
        busy = cur.num_requests_running or cur.num_requests_waiting
        if prev == cur and not busy:
            return None
        prompt_tps = (cur.prompt_tokens_total - prev.prompt_tokens_total) / elapsed_s
        gen_tps = (cur.generation_tokens_total - prev.generation_tokens_total) / elapsed_s
        queries = cur.prefix_cache_queries - prev.prefix_cache_queries
        hits = cur.prefix_cache_hits - prev.prefix_cache_hits
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {cur.num_requests_running} reqs, Waiting: {cur.num_requests_waiting} reqs, "
            f"Preemptions: {cur.num_preemptions_total}, "
            f"KV cache usage: {100.0 * cur.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )
