"""A worker's step trace at shutdown (workers/trace_summary.py): the executor's grace (and the host's wait for the
core) lasts while a worker writes its trace, so none is cut; the workers' code imports nothing of asyncllm.bench."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncllm import envs
from asyncllm.workers import executor as executor_module
from asyncllm.workers.executor import Executor
from asyncllm.workers import trace_summary
from asyncllm.workers.trace_summary import wait_for_exit, writing_marker

# A worker that writes its trace for 0.6 s under its marker (`writing_marker`, as `TracedPipeline._stop`), then says
# so; its stdin's EOF ends it at once, as a real worker's does (the executor's stop closes it).
_WRITER = """
import os, sys, threading, time
core = os.environ.get("ASYNCLLM_CORE_PID") or os.getpid()  # unset: it plays its own core too
marker = os.path.join(os.environ["ASYNCLLM_WORKER_TRACE_DIR"], f"worker-trace-writing-{core}-{os.getpid()}")
open(marker, "w").close()
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(1)), daemon=True).start()
print("writing", flush=True)
time.sleep(float(sys.argv[2]))
open(sys.argv[1], "w").close()
os.remove(marker)
"""


@pytest.fixture
def tracing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv(envs.WORKER_TRACE_STEPS.name, "0:1")
    monkeypatch.setenv(envs.WORKER_TRACE_DIR.name, str(tmp_path))
    return tmp_path


def _writer(done: Path, core: int | None = None, seconds: float = 0.6) -> subprocess.Popen:
    """A worker of `core` (None: its own core, as a host sees it) writing its trace for `seconds`."""
    env = {**os.environ, envs.CORE_PID_NAME: str(core or "")}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(done), str(seconds)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"writing\n"
    return proc


def test_the_executors_shutdown_waits_for_a_trace_being_written(monkeypatch, tracing: Path) -> None:
    monkeypatch.setattr(executor_module, "_SHUTDOWN_GRACE_S", 0.05)
    executor = Executor.__new__(Executor)  # only what `_stop_workers` reads: no ring, one live worker
    executor._failure, executor._ring, executor._procs = None, None, [_writer(tracing / "done", os.getpid())]
    executor._stop_workers()
    assert (tracing / "done").exists()
    assert not Path(writing_marker(executor._procs[0].pid)).exists()


@pytest.mark.parametrize("pid", ["the worker's", None], ids=["executor", "host"])
def test_wait_for_exit_lasts_while_a_trace_is_written_only(tracing: Path, pid: str | None) -> None:
    proc = _writer(tracing / "done", os.getpid() if pid else None)
    started = time.monotonic()
    wait_for_exit(proc, 0.05, proc.pid if pid else None)
    assert (tracing / "done").exists() and proc.wait(5) == 0
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # no trace: the grace only
    try:
        wait_for_exit(idle, 0.05, idle.pid if pid else None)
        assert idle.poll() is None and time.monotonic() - started < 10
    finally:
        idle.kill()
        idle.wait()


@pytest.mark.parametrize("pid", ["the worker's", None], ids=["executor", "host"])
def test_a_hung_writer_is_waited_for_a_bounded_time(monkeypatch, caplog, tracing: Path, pid: str | None) -> None:
    """A worker that never ends writing (hung in the profiler's stop) holds its marker until it is killed: the wait
    ends `TRACE_WRITE_WAIT_S` past the grace all the same."""
    monkeypatch.setattr(trace_summary, "TRACE_WRITE_WAIT_S", 0.5)
    proc = _writer(tracing / "done", os.getpid() if pid else None, seconds=8)
    try:
        started = time.monotonic()
        wait_for_exit(proc, 0.05, proc.pid if pid else None)
        assert proc.poll() is None and 0.5 <= time.monotonic() - started < 5
        assert "still writes its step trace" in caplog.text
    finally:
        proc.kill()
        proc.wait()


def test_a_host_waits_for_its_own_cores_workers_only(monkeypatch, tracing: Path) -> None:
    """A live worker of another core (another engine sharing the trace folder) writing its trace keeps no host
    waiting for its own core; one of its core does."""
    monkeypatch.setattr(trace_summary, "TRACE_WRITE_WAIT_S", 1.5)
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        Path(writing_marker(os.getpid(), core.pid + 1)).touch()  # this live process, as another core's worker
        started = time.monotonic()
        wait_for_exit(core, 0.05)
        assert core.poll() is None and time.monotonic() - started < 1
        Path(writing_marker(os.getpid(), core.pid)).touch()  # now as its core's own
        wait_for_exit(core, 0.05)
        assert time.monotonic() - started >= 1.5
    finally:
        core.kill()
        core.wait()


def test_a_workers_marker_names_the_core_that_waits_for_it(monkeypatch, tracing: Path) -> None:
    """The executor gives its workers its pid (`envs.CORE_PID_NAME`): the marker a worker writes is the one its
    executor and its core's host wait on."""
    spawned: list[dict[str, str]] = []
    monkeypatch.setattr(executor_module, "spawn_module", lambda module, args, env=None: spawned.append(env))
    executor = Executor.__new__(Executor)  # only what `_spawn_workers` reads
    executor._ring, executor._ipc_dir, executor._world_size = SimpleNamespace(handle={}), str(tracing), 2
    executor.config, executor._runner, executor._hf_config_json = SimpleNamespace(to_dict=lambda wire: {}), None, None
    executor._procs = []
    executor._spawn_workers()
    assert len(spawned) == 2
    for env in spawned:
        monkeypatch.setattr(os, "environ", {**os.environ, **env})
        assert writing_marker(1234) == writing_marker(1234, os.getpid())


def test_the_workers_import_nothing_of_bench() -> None:
    folder = Path(executor_module.__file__).parent
    assert [p.name for p in folder.glob("*.py") if "asyncllm.bench" in p.read_text()] == []
