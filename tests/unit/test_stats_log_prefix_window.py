"""The stats line's prefix-cache hit rate is vLLM's: over the most recent 1000 requests that queried the cache
(vLLM's ``CachingMetrics(max_recent_requests=1000)``), not the interval's; the core counts those requests."""

from __future__ import annotations

import logging

from asyncllm.engine.stats_log import StatsLogger
from asyncllm.kv.manager import KVCacheManager
from asyncllm.metrics.host_stats import HostStats
from asyncllm.outputs import EngineStats
from asyncllm.protocol import SchedulerStats
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request


class _Snapshots:
    """A `HostStats` stand-in whose snapshots are the engine-wide counters given, one per `StatsLogger` line."""

    def __init__(self) -> None:
        self.current = EngineStats()

    def snapshot(self) -> EngineStats:
        return self.current


def _lines(caplog, counters: list[tuple[int, int, int]]) -> list[str]:
    """The hit rates of the lines logged after each cumulative (requests, queries, hits) of the core in turn."""
    source = _Snapshots()
    stats_logger = StatsLogger(0.0, source)  # every call logs a line
    rates = []
    for requests, queries, hits in counters:
        source.current = EngineStats(num_requests_running=1, prefix_cache_requests=requests,
                                     prefix_cache_queries=queries, prefix_cache_hits=hits)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="asyncllm.engine.stats"):
            stats_logger.maybe_log()
        (record,) = caplog.records
        rates.append(record.getMessage().split("Prefix cache hit rate: ")[1])
    return rates


def test_hit_rate_is_over_the_most_recent_1000_requests(caplog) -> None:
    # until 2026-12-08 each line's rate was its interval's: 50.0%, 0.0% (no new request), 75.0%, 0.0%
    assert _lines(caplog, [
        (10, 1000, 500),     # 10 requests: 500 of 1000 tokens hit
        (10, 1000, 500),     # decoding only: no request, the window stays (vLLM skips empty observations)
        (1000, 2000, 1500),  # 990 more, every token hit: 1000 requests in the window
        (1001, 2100, 1500),  # one more: past 1000, the oldest observation (the first 10 requests) leaves
    ]) == ["50.0%", "50.0%", "75.0%", "90.9%"]


def test_a_counter_reset_starts_the_window_over(caplog) -> None:
    """A shared core that restarted under the host counts from 0 again: its requests alone are the window."""
    assert _lines(caplog, [(10, 1000, 1000), (2, 100, 25)]) == ["100.0%", "25.0%"]


def test_the_core_counts_each_request_that_queried_the_cache() -> None:
    """One per admission that looked up the cache (a preempted request's readmission is none, as its tokens are
    none), sent to the host with the core's counters and in the host's snapshot."""
    kv = KVCacheManager(num_gpu_blocks=16, block_size=16, enable_prefix_caching=True)
    for name in ("a", "b"):
        req = Request(name, list(range(100, 140)), SamplingParams(), [0], 0.0)
        hits, num_hit = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
        req.num_computed_tokens = req.num_tokens
        kv.cache_full_blocks(req)
    kv.free(req)
    req.num_preemptions, req.num_computed_tokens = 1, 0
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    assert (kv.prefix_cache_requests, kv.prefix_cache_queries) == (2, 80)
    host = HostStats("m")
    host.scheduler = SchedulerStats(prefix_cache_requests=2, prefix_cache_queries=80)
    assert host.snapshot().prefix_cache_requests == 2
