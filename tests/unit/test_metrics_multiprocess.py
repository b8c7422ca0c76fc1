"""Prometheus multiprocess mode: two host processes' series, read back by a MultiProcessCollector, summed."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from asyncllm.metrics import multiprocess, prometheus
from asyncllm.metrics.host_stats import HostStats
from asyncllm.metrics.multiprocess import _Writer
from asyncllm.metrics.multiprocess_files import LIVE_GAUGES
from asyncllm.metrics.observer import RequestObserver
from asyncllm.metrics.prometheus import AsyncLLMCollector
from asyncllm.protocol import SchedulerStats


def _host(pid: int, generated: int, ttft: float) -> tuple[_Writer, HostStats]:
    """One host process: its `HostStats` in a collector, written as process `pid` would."""
    stats = HostStats("m")
    stats.generation_tokens_total = generated
    stats.count_finished("length")
    stats.time_to_first_token.observe(ttft)
    collector = AsyncLLMCollector()
    collector.add(stats)
    writer = _Writer(pid)
    writer.collectors.add(collector)
    writer._collector = collector  # held: the writer holds its collectors weakly
    return writer, stats


def _scrape(folder: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


def test_two_hosts_sum_counters_and_report_engine_series_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    (a, reporter), (b, other) = _host(1001, 10, 0.003), _host(1002, 20, 0.5)
    for stats, reports in ((reporter, True), (other, False)):  # every host gets the core's snapshots
        stats.take_snapshot(SchedulerStats(num_requests_running=3, num_preemptions_total=4), reports)
    a.sync(), b.sync()
    reporter.take_snapshot(SchedulerStats(num_requests_running=1, num_preemptions_total=6), True)
    reporter.generation_tokens_total += 5
    a.sync(), b.sync()
    m = (("engine", "0"), ("model_name", "m"))
    scraped = _scrape(str(tmp_path))
    assert scraped[("asyncllm:generation_tokens_total", m)] == 35
    assert scraped[("asyncllm:request_success_total", (m[0], ("finished_reason", "length"), m[1]))] == 2
    assert scraped[("asyncllm:num_requests_running", m)] == 1  # the reporter's latest, once
    assert scraped[("asyncllm:num_preemptions_total", m)] == 6  # the core's count, once
    assert scraped[("asyncllm:time_to_first_token_seconds_count", m)] == 2
    assert scraped[("asyncllm:time_to_first_token_seconds_bucket", (m[0], ("le", "0.005"), m[1]))] == 1
    assert scraped[("asyncllm:time_to_first_token_seconds_bucket", (m[0], ("le", "+Inf"), m[1]))] == 2
    assert scraped[("asyncllm:time_to_first_token_seconds_sum", m)] == pytest.approx(0.503)
    b.collectors.discard(b._collector)  # its engine was garbage-collected: its counts stay, a new one's add up
    b._collector, new = AsyncLLMCollector(), HostStats("m")
    new.generation_tokens_total = 1
    b._collector.add(new)
    b.collectors.add(b._collector)
    b.sync()
    assert _scrape(str(tmp_path))[("asyncllm:generation_tokens_total", m)] == 36


def test_gauges_and_engine_counters_follow_the_reporter(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    (a, reporter), (b, other) = _host(2001, 1, 0.1), _host(2002, 1, 0.1)
    reporter.take_snapshot(SchedulerStats(num_requests_running=3, num_preemptions_total=4), True)
    a.sync(), b.sync()
    reporter.mark_closed()  # the reporter's engine closed: the other host takes over
    for preemptions in (5, 7):
        other.take_snapshot(SchedulerStats(num_requests_running=2, num_preemptions_total=preemptions), True)
        a.sync(), b.sync()
    scraped = _scrape(str(tmp_path))
    assert scraped[("asyncllm:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 2
    assert scraped[("asyncllm:num_preemptions_total", (("engine", "0"), ("model_name", "m")))] == 6  # 4, then 5 -> 7 (not 4 + 7)
    other.mark_closed()
    b.sync()
    assert ("asyncllm:num_requests_running", (("engine", "0"), ("model_name", "m"))) not in _scrape(str(tmp_path))
    for preemptions in (8, 9):  # the first host reports again: from 8 on, not from its own 4
        reporter.take_snapshot(SchedulerStats(num_requests_running=1, num_preemptions_total=preemptions), True)
        a.sync()
    assert _scrape(str(tmp_path))[("asyncllm:num_preemptions_total", (("engine", "0"), ("model_name", "m")))] == 7
    a.files.remove_live(), b.files.remove_live()  # both exit
    assert _scrape(str(tmp_path))[("asyncllm:generation_tokens_total", (("engine", "0"), ("model_name", "m")))] == 2


def test_engines_of_one_process_combine_their_gauges_as_one_registry(tmp_path, monkeypatch) -> None:
    """Two engines with private registries in one process: KV usage as blocks, `lora_requests_info` the time."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    writer, _ = _host(4001, 0, 0.1)
    second, stats = AsyncLLMCollector(), HostStats("m")
    second.add(stats)
    writer.collectors.add(second)
    for host in (stats, *writer._collector.sources()):
        host.take_snapshot(SchedulerStats(num_requests_running=1, num_gpu_blocks=8, num_used_blocks=3, max_lora=1), True)
    before = time.time()
    writer.sync()
    scraped = _scrape(str(tmp_path))
    m = (("engine", "0"), ("model_name", "m"))
    assert scraped[("asyncllm:num_requests_running", m)] == 2
    assert scraped[("asyncllm:kv_cache_usage_perc", m)] == 0.375  # (3 + 3) / (8 + 8), not 0.375 + 0.375
    info = [v for (name, _), v in scraped.items() if name == "asyncllm:lora_requests_info"]
    assert len(info) == 1 and before <= info[0] <= time.time()
    reads, sources = [], AsyncLLMCollector.sources
    monkeypatch.setattr(AsyncLLMCollector, "sources", lambda self: reads.append(self) or sources(self))
    writer.sync()  # the folder's counters already looked up: one pass
    assert len(reads) == 2  # each engine's view read once a sync, for its series and the combined gauges alike


def test_metrics_route_serves_the_folder_without_a_name_held_before_attaching(tmp_path, monkeypatch) -> None:
    from asyncllm.integrations.openai_info import _Handlers

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    writer, stats = _host(3001, 0, 0.1)
    stats.model_name, stats.named = "ipc:///tmp/core.sock", False  # an attached host until the core names its model
    stats.generation_tokens_total = 2
    writer.sync()
    stats.model_name, stats.named, stats.generation_tokens_total = "m", True, 3
    writer.sync()
    engine = SimpleNamespace(metrics_registry=CollectorRegistry())  # empty: the route reads the folder
    body = asyncio.run(_Handlers(SimpleNamespace(engine=engine)).metrics(None)).body.decode()
    assert 'asyncllm:generation_tokens_total{engine="0",model_name="m"} 3.0' in body
    assert 'asyncllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 0.0' in body
    assert 'asyncllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0' in body
    assert "ipc://" not in body


def test_attach_mirrors_only_in_multiprocess_mode(tmp_path, monkeypatch) -> None:
    mirrored: list[AsyncLLMCollector] = []
    monkeypatch.setattr(prometheus, "mirror", mirrored.append)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    prometheus.attach(HostStats("m"))
    assert mirrored == []
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    registry = prometheus.attach(HostStats("m"))
    assert mirrored == [prometheus._collectors[registry]]


def test_a_renamed_host_moves_its_series_to_the_new_name(tmp_path, monkeypatch) -> None:
    """`AsyncEngine.set_served_model_name` after start: the old name's series leave the files, none counts twice."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    observer = RequestObserver("m")  # its collector goes to this test's writer, not the module's
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    stats, writer = observer.stats, _Writer(5001)
    writer.collectors.add(prometheus._collectors[observer.registry])
    stats.owns_core, stats.generation_tokens_total = True, 4
    stats.time_to_first_token.observe(0.1)
    stats.take_snapshot(SchedulerStats(num_requests_running=2, num_preemptions_total=3), True)
    writer.sync()
    monkeypatch.setattr(multiprocess, "_writer", writer)
    observer.serve_as("served")
    stats.generation_tokens_total += 1
    writer.sync()
    scraped = _scrape(str(tmp_path))
    assert not any(dict(labels).get("model_name") == "m" for _, labels in scraped)
    served = (("engine", "0"), ("model_name", "served"))
    assert scraped[("asyncllm:generation_tokens_total", served)] == 5
    assert scraped[("asyncllm:num_preemptions_total", served)] == 3
    assert scraped[("asyncllm:time_to_first_token_seconds_count", served)] == 1
    assert scraped[("asyncllm:num_requests_running", served)] == 2


def test_lora_adapter_sets_no_longer_running_leave_the_gauge_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    writer, stats = _host(5002, 0, 0.1)
    for adapter in range(20):  # adapters loaded, used, unloaded
        stats.take_snapshot(SchedulerStats(max_lora=1, running_lora_adapters=[f"a{adapter}"]), True)
        writer.sync()
    held = MmapedDict.read_all_values_from_file(writer.files.path(LIVE_GAUGES))
    assert sorted(json.loads(key)[2].get("running_lora_adapters", "") for key, *_ in held) == ["", "", "", "a19"]
    info = [labels for name, labels in _scrape(str(tmp_path)) if name == "asyncllm:lora_requests_info"]
    assert [dict(labels)["running_lora_adapters"] for labels in info] == ["a19"]


def test_cache_config_info_and_the_parent_request_histograms_cross_processes(tmp_path, monkeypatch) -> None:
    """``cache_config_info`` is a reporter's gauge (value 1 once, not summed); ``request_params_n`` adds up."""
    from asyncllm.config import CacheConfig
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    (a, reporter), (b, other) = _host(3001, 1, 0.1), _host(3002, 1, 0.1)
    for stats, reports in ((reporter, True), (other, False)):
        stats.set_cache_config(CacheConfig(block_size=32))
        stats.take_snapshot(SchedulerStats(num_gpu_blocks=7), reports)
        stats.request_params_n.observe(2)
    a.sync(), b.sync()
    scraped = _scrape(str(tmp_path))
    [(labels, value)] = [(dict(k[1]), v) for k, v in scraped.items() if k[0] == "asyncllm:cache_config_info"]
    assert value == 1 and (labels["block_size"], labels["num_gpu_blocks"], labels["model_name"]) == ("32", "7", "m")
    m = (("engine", "0"), ("model_name", "m"))
    assert scraped[("asyncllm:request_params_n_bucket", (m[0], ("le", "2.0"), m[1]))] == 2
