"""The soak benchmark's pass/fail checks and its bounded lag probe (no engine: the soak itself is a benchmark)."""

from __future__ import annotations

import argparse

from asyncllm.bench.soak import _LagProbe, _problems, _RESERVOIR

ARGS = argparse.Namespace(max_rss_growth=0.25)


def _metrics(**changes: object) -> dict:
    metrics = {"num_error": 0, "errors": [], "kv_blocks_in_use_after": 0, "requests_left_after": 0,
               "rss_host_start_mib": 400.0, "rss_host_end_mib": 420.0,
               "rss_worker0_start_mib": 1000.0, "rss_worker0_end_mib": 1000.5}
    metrics.update(changes)
    return metrics


def test_a_clean_run_passes() -> None:
    assert _problems(ARGS, _metrics()) == []


def test_errors_leftovers_and_memory_growth_fail() -> None:
    assert _problems(ARGS, _metrics(num_error=2, errors=["EngineDeadError: x"])) == [
        "2 requests failed: ['EngineDeadError: x']"]
    assert _problems(ARGS, _metrics(kv_blocks_in_use_after=3)) == [
        "after the load: 3 KV blocks in use, 0 requests left"]
    assert _problems(ARGS, _metrics(rss_host_end_mib=520.0)) == ["host RSS grew from 400 to 520 MiB"]
    assert _problems(ARGS, _metrics(rss_host_end_mib=460.0)) == []  # under 64 MiB: allocator noise


def test_lag_probe_keeps_a_bounded_reservoir() -> None:
    probe = _LagProbe(seed=0)
    for i in range(3 * _RESERVOIR):
        probe._add(float(i))
    assert probe.count == 3 * _RESERVOIR and len(probe.samples) == _RESERVOIR
    assert max(probe.samples) > 2 * _RESERVOIR  # later samples replaced earlier ones
