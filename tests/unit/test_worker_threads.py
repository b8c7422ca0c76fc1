"""A CPU worker's torch threads (`workers.worker.cpu_threads`): its share of the cores, unless OMP_NUM_THREADS
is set (the test suite sets 1: two test processes share two cores, and workers taking both each oversubscribed
them)."""

from __future__ import annotations

import pytest

from asyncllm.workers.worker import cpu_threads


def test_share_of_the_cores_without_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert cpu_threads(1) == 16
    assert cpu_threads(4) == 4
    assert cpu_threads(32) == 1


def test_omp_num_threads_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(1) is None  # torch keeps the count it read at import
    for ignored in ("", "0", "abc", "-2"):  # not a count: torch ignores it, so the worker takes its share
        monkeypatch.setenv("OMP_NUM_THREADS", ignored)
        assert cpu_threads(2) == 8, ignored


def test_share_of_the_cores_the_process_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``taskset -c 0-3`` (or a container's cpuset) on a 64-core machine each worker's share is of the 4
    cores it may run on, as torch's own default is: not 64 threads fighting over 4 cores."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpu_threads(1) == 4
    assert cpu_threads(2) == 2
    assert cpu_threads(8) == 1
    monkeypatch.delattr("os.sched_getaffinity", raising=False)  # macOS, Windows: every core
    assert cpu_threads(2) == 32
