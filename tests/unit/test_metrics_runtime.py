"""The server's /metrics carries prometheus_client's process_*, python_gc_* and python_info series as vLLM's does,
once per scrape, never in multiprocess mode, and never registered in the host's registry."""

from __future__ import annotations

import asyncio
import re
import sys
from types import SimpleNamespace

import prometheus_client
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from asyncllm.integrations.openai_info import _Handlers
from asyncllm.metrics.host_stats import HostStats
from asyncllm.metrics.prometheus import attach

RUNTIME = ["python_gc_objects_collected_total", "python_info"]
RUNTIME += ["process_cpu_seconds_total", "process_resident_memory_bytes"] if sys.platform == "linux" else []


def _scrape(registry: CollectorRegistry) -> str:
    engine = SimpleNamespace(metrics_registry=registry)
    return asyncio.run(_Handlers(SimpleNamespace(engine=engine)).metrics(None)).body.decode()


def _types(body: str) -> list[str]:
    return re.findall(r"^# TYPE (\S+)", body, flags=re.MULTILINE)


def test_metrics_route_adds_the_process_series_to_a_private_registry(monkeypatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    registry = attach(HostStats("m"))
    body = _scrape(registry)
    types = _types(body)
    assert "asyncllm:num_requests_running" in types
    assert [name for name in RUNTIME if name not in types] == []
    assert len(types) == len(set(types))  # no family twice
    assert re.search(r'^python_info\{.*implementation="', body, flags=re.MULTILINE)
    # the host's registry is left as it was: nothing but asyncllm's collector in it
    assert not any(m.name.startswith(("python_", "process_")) for m in registry.collect())


def test_a_registry_with_the_default_collectors_gets_them_once(monkeypatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    own = attach(HostStats("m"))
    for collector in (ProcessCollector, GCCollector, PlatformCollector):
        collector(registry=own)
    for registry in (own, prometheus_client.REGISTRY):  # the host passed prometheus_registry=REGISTRY
        types = _types(_scrape(registry))
        assert [name for name in RUNTIME if types.count(name) != 1] == [], registry


def test_multiprocess_mode_serves_no_process_series(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    types = _types(_scrape(CollectorRegistry()))
    assert [name for name in RUNTIME if name in types] == []
