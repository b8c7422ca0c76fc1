"""Prometheus multiprocess mode: the writer over forks, a bad folder, idle hosts, hidden gauges and engine restarts."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from asyncllm import AsyncEngine
from asyncllm.engine import replica as replica_module
from asyncllm.errors import ConfigError
from asyncllm.metrics import multiprocess, multiprocess_files, prometheus
from asyncllm.metrics.host_stats import HostStats
from asyncllm.metrics.multiprocess import _Writer
from asyncllm.metrics.multiprocess_files import LIVE_GAUGES, reap_dead
from asyncllm.metrics.observer import RequestObserver
from asyncllm.metrics.prometheus import AsyncLLMCollector
from asyncllm.protocol import SchedulerStats

M = (("engine", "0"), ("model_name", "m"))


def _writer(pid: int, *stats: HostStats) -> _Writer:
    writer = _Writer(pid)
    writer.held = []  # the writer holds its collectors weakly
    for one in stats:
        collector = AsyncLLMCollector()
        collector.add(one)
        writer.collectors.add(collector)
        writer.held.append(collector)
    return writer


def _scrape(folder: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


@pytest.fixture
def folder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    return str(tmp_path)


@pytest.fixture
def module_writer(folder, monkeypatch: pytest.MonkeyPatch):
    """The module's own writer, as a host process has it; its thread stopped and no atexit hook left behind."""
    monkeypatch.setattr(multiprocess, "_writer", None)
    monkeypatch.setattr(multiprocess, "atexit", SimpleNamespace(register=lambda *args: None))
    yield
    if multiprocess._writer is not None:
        multiprocess._writer.thread_pid = None  # its thread ends after its next sleep


def test_forked_child_writes_its_own_growth_once_even_if_the_lock_was_held(folder, module_writer) -> None:
    observer = RequestObserver("m")
    observer.stats.generation_tokens_total = 5
    multiprocess.sync()
    holder = threading.Thread(target=lambda: (multiprocess._writer.lock.acquire(), time.sleep(0.2),
                                              multiprocess._writer.lock.release()))
    holder.start()
    time.sleep(0.05)
    pid = os.fork()  # while another thread holds the writer's lock
    if pid == 0:
        signal.alarm(5)  # an inherited held lock would hang the child
        observer.on_scheduler_stats(SchedulerStats(num_requests_running=1), True)  # starts the child's writer
        threads = [t.name for t in threading.enumerate()]
        observer.stats.generation_tokens_total += 2
        multiprocess._at_exit(multiprocess._writer)  # its exit: its own growth, not the parent's 5 again
        os._exit(0 if "asyncllm-prometheus-multiproc" in threads else 3)
    holder.join()
    assert os.waitpid(pid, 0)[1] == 0
    scraped = _scrape(folder)
    assert scraped[("asyncllm:generation_tokens_total", M)] == 7
    assert ("asyncllm:num_requests_running", M) not in scraped  # the child's gauges left with it


def test_at_exit_of_a_process_that_is_not_the_writers_writes_nothing(folder) -> None:
    stats = HostStats("m")
    stats.generation_tokens_total = 5
    writer = _writer(os.getpid(), stats)
    writer.pid = os.getpid() + 1  # forked without the hooks: the parent's files
    multiprocess._at_exit(writer)
    assert os.listdir(folder) == []


def test_a_folder_that_is_not_there_is_refused_at_attach(tmp_path, monkeypatch, module_writer) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    registry = CollectorRegistry()
    with pytest.raises(ConfigError, match="PROMETHEUS_MULTIPROC_DIR"):
        prometheus.attach(HostStats("m"), registry)
    assert list(registry.collect()) == []  # nothing registered


def test_retire_logs_a_failed_write(folder, module_writer, monkeypatch, caplog) -> None:
    stats = HostStats("m")
    registry = prometheus.attach(stats)

    def full() -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(multiprocess._writer, "sync", full)
    stats.mark_closed()
    prometheus.retire(stats, registry)
    with caplog.at_level(logging.ERROR, logger="asyncllm.engine"):
        multiprocess.sync()  # as aclose writes the closed engine's last counts
    assert "could not write the Prometheus series" in caplog.text


def test_files_of_processes_no_longer_running_are_warned_about(folder, module_writer, caplog) -> None:
    for name in ("counter_4194305.db", f"counter_{os.getpid()}.db"):  # above pid_max: never running
        open(os.path.join(folder, name), "wb").close()
    with caplog.at_level(logging.WARNING, logger="asyncllm.engine"):
        prometheus.attach(HostStats("m"))
        prometheus.attach(HostStats("m"))
    assert caplog.text.count("no longer running") == 1
    assert "counter_4194305.db" in caplog.text and f"counter_{os.getpid()}.db" not in caplog.text


def test_an_idle_reporter_writes_its_series_but_an_unnamed_host_none(folder) -> None:
    idle, unnamed = HostStats("m"), HostStats("ipc:///tmp/core.sock", named=False)
    idle.take_snapshot(SchedulerStats(num_requests_running=3), True)
    _writer(4001, idle, unnamed).sync()
    scraped = _scrape(folder)
    assert scraped[("asyncllm:num_requests_running", M)] == 3
    assert scraped[("asyncllm:generation_tokens_total", M)] == 0
    assert not any("ipc://" in dict(labels).get("model_name", "") for _, labels in scraped)


def test_a_gauge_no_longer_exported_leaves_and_a_killed_process_gauges_are_reaped(folder) -> None:
    stats = HostStats("m")
    stats.take_snapshot(SchedulerStats(num_requests_running=3), True)
    writer = _writer(4002, stats)
    writer.sync()
    stats.mark_closed()
    writer.sync()
    assert ("asyncllm:num_requests_running", M) not in _scrape(folder)
    assert list(MmapedDict.read_all_values_from_file(writer.files.path(LIVE_GAUGES))) == []
    stats.take_snapshot(SchedulerStats(num_requests_running=1), True)
    writer.sync()
    reap_dead(folder, lambda pid: pid != 4002)  # another worker's thread, 4002 killed
    assert sorted(os.listdir(folder)) == ["counter_asyncllm_4002.db", "histogram_asyncllm_4002.db"]


def test_a_reused_pid_carries_on_a_dead_process_counters_but_not_its_gauges(folder) -> None:
    """A container restarted with the same pids and the folder kept: no counter reset, no dead gauge left."""
    dead, alive = HostStats("m"), HostStats("m")
    dead.generation_tokens_total = 100
    dead.time_to_first_token.observe(0.003)
    dead.take_snapshot(SchedulerStats(num_requests_running=3, num_requests_waiting=2), True)
    _writer(4006, dead).sync()
    alive.generation_tokens_total = 1
    alive.take_snapshot(SchedulerStats(num_requests_running=1), True)
    alive.mark_closed()  # its gauges leave: none of the dead process's may stay in their place
    writer = _writer(4006, alive)
    writer.sync()
    assert list(MmapedDict.read_all_values_from_file(writer.files.path(LIVE_GAUGES))) == []
    scraped = _scrape(folder)
    assert scraped[("asyncllm:generation_tokens_total", M)] == 101
    assert scraped[("asyncllm:time_to_first_token_seconds_count", M)] == 1
    assert ("asyncllm:num_requests_running", M) not in scraped
    assert ("asyncllm:num_requests_waiting", M) not in scraped


def test_at_exit_stops_the_thread_before_its_last_write(folder, module_writer) -> None:
    """The daemon thread runs on during atexit: its next sync must not write the removed gauge file again."""
    stats = HostStats("m")
    stats.take_snapshot(SchedulerStats(num_requests_running=3), True)
    registry = prometheus.attach(stats)  # held: the writer holds its collector weakly
    writer = multiprocess._writer
    multiprocess._at_exit(writer)
    assert registry is not None and writer.files._keys[LIVE_GAUGES]  # its last write held the gauges
    assert not os.path.exists(writer.files.path(LIVE_GAUGES))
    stats.mark_closed()  # its gauges leave: a sync would write the gauge file anew
    writer.sync()  # the thread's next sync
    multiprocess.sync()  # another atexit hook's, which would restart the thread
    assert not os.path.exists(writer.files.path(LIVE_GAUGES)) and writer.thread_pid is None


def test_engines_with_their_own_cores_count_from_0(folder) -> None:
    """A second engine of the process, and a restarted one, each on a core of its own."""
    first, second = HostStats("m"), HostStats("m")
    first.owns_core = second.owns_core = True
    first.take_snapshot(SchedulerStats(num_preemptions_total=5), True)
    writer = _writer(4003, first)
    writer.sync()
    collector = AsyncLLMCollector()
    collector.add(second)
    writer.collectors.add(collector)
    second.take_snapshot(SchedulerStats(num_preemptions_total=3), True)
    writer.sync()
    assert _scrape(folder)[("asyncllm:num_preemptions_total", M)] == 8


def test_mirror_waits_for_a_sync_and_the_thread_survives_any_error(folder, module_writer, monkeypatch,
                                                                   caplog) -> None:
    prometheus.attach(HostStats("m"))
    writer, calls = multiprocess._writer, []
    with writer.lock:  # a sync in progress: the collectors must not change under it
        adder = threading.Thread(target=prometheus.attach, args=(HostStats("m"),))
        adder.start()
        adder.join(0.1)
        assert adder.is_alive()
    adder.join()

    def failing() -> None:
        calls.append(1)
        if len(calls) >= 3:
            writer.thread_pid = None
        raise RuntimeError("a bug")

    monkeypatch.setattr(writer, "sync", failing)
    monkeypatch.setattr(multiprocess, "SYNC_INTERVAL_S", 0.001)
    writer.thread_pid = os.getpid()
    with caplog.at_level(logging.ERROR, logger="asyncllm.engine"):
        multiprocess._sync_forever(writer)
    assert len(calls) == 3 and caplog.text.count("could not write") == 1


def test_the_folder_is_read_outside_the_lock_once_per_counter(folder, monkeypatch) -> None:
    """A shared core's engine-wide counter first reported: another process's file is looked up, with the writer's
    lock free (an engine attaching or a scrape does not wait), and once."""
    first, second = HostStats("m"), HostStats("m")
    first.take_snapshot(SchedulerStats(num_preemptions_total=4), True)
    _writer(4004, first).sync()
    writer, lookups = _writer(4005, second), []

    def looked_up(where: str, keys) -> set[str]:
        assert writer.lock.acquire(blocking=False)
        writer.lock.release()
        lookups.append(list(keys))
        return multiprocess_files.reported_elsewhere(where, lookups[-1])

    monkeypatch.setattr(multiprocess, "reported_elsewhere", looked_up)
    for preemptions in (6, 9):  # the second host takes over from 6 on
        second.take_snapshot(SchedulerStats(num_preemptions_total=preemptions), True)
        writer.sync()
    assert len(lookups) == 1 and any('"asyncllm:num_preemptions_total"' in key for key in lookups[0])
    assert _scrape(folder)[("asyncllm:num_preemptions_total", M)] == 7


async def test_aclose_writes_once_for_all_replicas_off_the_event_loop(folder, module_writer, monkeypatch) -> None:
    engine = AsyncEngine("m", data_parallel_size=3)
    engine._started, engine._forgotten = True, weakref.finalize(engine, lambda: None)
    engine._loop, engine._owner_pid = asyncio.get_running_loop(), os.getpid()

    monkeypatch.setattr(replica_module, "stop_replicas", lambda replicas: None)  # `stop_all`'s, with no process to stop
    threads: list[threading.Thread] = []
    monkeypatch.setattr(multiprocess, "sync", lambda: threads.append(threading.current_thread()))
    await engine.aclose()
    assert len(threads) == 1 and threads[0] is not threading.current_thread()
    assert all(replica.observer.stats.engine.closed for replica in engine._replicas)
