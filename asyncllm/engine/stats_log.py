"""The periodic stats log line, in the spirit of vLLM's.

Logged on the ``asyncllm.engine.stats`` logger only: the host's logging
configuration decides where it goes (asyncllm never adds a handler to the
root logger of the host process; ``asyncllm serve``, asyncllm's own process,
sends it to stderr when nothing is configured: `cli_commands.log_stats`).
Throughputs count this host's requests; running, waiting, preemptions, KV
usage and the prefix-cache hit rate are engine-wide (see docs/observability.md).
The hit rate is vLLM's: over the most recent 1000 requests that queried the
cache (`PrefixCacheWindow`), not the interval's.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from asyncllm.metrics.host_stats import HostStats
from asyncllm.outputs import EngineStats

logger = logging.getLogger("asyncllm.engine.stats")


class StatsLogger:
    """Logs one line every `interval_s` while the engine is busy (or just was); runs on the processor thread."""

    def __init__(self, interval_s: float, stats: HostStats, prefix: str = "") -> None:
        self.interval_s = interval_s
        self._stats = stats
        self._prefix = prefix
        """Put before each line: "Engine 001: " for a data-parallel replica's core (vLLM's form), else empty."""
        self._last = stats.snapshot()
        self._last_time = time.monotonic()
        self._prefix_cache = PrefixCacheWindow()

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_time < self.interval_s:
            return
        current = self._stats.snapshot()
        self._prefix_cache.observe(self._last, current)
        line = self.format_line(self._last, current, now - self._last_time, self._prefix_cache.hit_rate)
        if line is not None:
            logger.info(self._prefix + line)
        self._last, self._last_time = current, now

    @staticmethod
    def format_line(prev: EngineStats, cur: EngineStats, elapsed_s: float,
                    prefix_cache_hit_rate: float | None = None) -> str | None:
        """None when nothing happened since `prev` and nothing is in flight; `prefix_cache_hit_rate`: the line's
        (0 to 1, `PrefixCacheWindow`'s), None: the interval's."""
        busy = cur.num_requests_running or cur.num_requests_waiting
        if not busy and _activity(prev) == _activity(cur):
            return None
        prompt_tps = (cur.prompt_tokens_total - prev.prompt_tokens_total) / elapsed_s
        gen_tps = (cur.generation_tokens_total - prev.generation_tokens_total) / elapsed_s
        if prefix_cache_hit_rate is None:
            before = _since(prev, cur, "prefix_cache_queries")
            queries = cur.prefix_cache_queries - before.prefix_cache_queries
            hits = cur.prefix_cache_hits - before.prefix_cache_hits
            prefix_cache_hit_rate = hits / queries if queries else 0.0
        hit_rate = 100.0 * prefix_cache_hit_rate
        return (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {cur.num_requests_running} reqs, Waiting: {cur.num_requests_waiting} reqs, "
            f"Preemptions: {cur.num_preemptions_total}, "
            f"KV cache usage: {100.0 * cur.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        ) + _spec_decoding(prev, cur)


def _spec_decoding(prev: EngineStats, cur: EngineStats) -> str:
    """vLLM's speculative-decoding figures over the interval ('' when no draft was verified in it)."""
    prev = _since(prev, cur, "spec_decode_num_drafts")
    drafts = cur.spec_decode_num_drafts - prev.spec_decode_num_drafts
    if not drafts:
        return ""
    drafted = cur.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
    accepted = cur.spec_decode_num_accepted_tokens - prev.spec_decode_num_accepted_tokens
    before = prev.spec_decode_accepted_per_pos or [0] * len(cur.spec_decode_accepted_per_pos)
    per_pos = ", ".join(f"{(n - m) / drafts:.3f}" for n, m in zip(cur.spec_decode_accepted_per_pos, before))
    return (f", SpecDecoding: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Draft acceptance rate: {100.0 * accepted / drafted:.1f}%, Per-position acceptance rate: {per_pos}")


class PrefixCacheWindow:
    """vLLM's ``CachingMetrics(max_recent_requests=1000)``, the hit rate of its stats line: the prefix-cache queries
    and hits of the most recent requests that queried the cache, observed per line (each interval's new requests,
    queries and hits; vLLM observes each step's). An observation without a new request is skipped, so the rate holds
    while the engine only decodes; past `max_recent_requests` requests the oldest observations leave, the latest
    always stays. A core whose counters went down (a shared core restarted) starts the window over."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self._observed: deque[tuple[int, int, int]] = deque()
        """(requests, queries, hits) of each observation in the window, oldest first."""
        self.requests = self.queries = self.hits = 0

    def observe(self, prev: EngineStats, cur: EngineStats) -> None:
        """The counts `cur` added to `prev`'s (all of `cur`'s after a counter reset, which empties the window)."""
        before = _since(prev, cur, "prefix_cache_requests")
        if before is _NO_COUNTS:
            self._observed.clear()
            self.requests = self.queries = self.hits = 0
        requests = cur.prefix_cache_requests - before.prefix_cache_requests
        if requests <= 0:
            return
        observed = (requests, cur.prefix_cache_queries - before.prefix_cache_queries,
                    cur.prefix_cache_hits - before.prefix_cache_hits)
        self._observed.append(observed)
        self._add(observed, 1)
        while len(self._observed) > 1 and self.requests > self.max_recent_requests:
            self._add(self._observed.popleft(), -1)

    def _add(self, observed: tuple[int, int, int], sign: int) -> None:
        self.requests += sign * observed[0]
        self.queries += sign * observed[1]
        self.hits += sign * observed[2]

    @property
    def hit_rate(self) -> float:
        """Hits over queries in the window, 0 to 1 (0.0 while it is empty)."""
        return self.hits / self.queries if self.queries else 0.0


_NO_COUNTS = EngineStats()


def _since(prev: EngineStats, cur: EngineStats, counter: str) -> EngineStats:
    """What the interval's engine-wide figures count from: `prev`, or nothing when the core's `counter` went down
    since (a shared core that restarted under an attached host counts from 0 again: all of `cur`'s counts are new,
    as Prometheus' rate() reads a counter reset)."""
    return prev if getattr(cur, counter) >= getattr(prev, counter) else _NO_COUNTS


def _activity(stats: EngineStats) -> tuple[int, ...]:
    """What changes when the engine works (not num_gpu_blocks, which arrives once at start)."""
    return (stats.prompt_tokens_total, stats.generation_tokens_total, stats.num_preemptions_total,
            stats.prefix_cache_queries, stats.num_used_blocks)
