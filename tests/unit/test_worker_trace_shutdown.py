"""A worker's step trace at shutdown (workers/trace_summary.py): the executor's grace (and the host's wait for the
core) lasts while a worker writes its trace, so none is cut; the workers' code imports nothing of asyncllm.bench."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncllm import envs
from asyncllm.workers import executor as executor_module
from asyncllm.workers.executor import Executor
from asyncllm.workers.trace_summary import wait_for_exit, writing_marker

# A worker that writes its trace for 0.6 s under its marker (`writing_marker`, as `TracedPipeline._stop`), then says
# so; its stdin's EOF ends it at once, as a real worker's does (the executor's stop closes it).
_WRITER = """
import os, sys, threading, time
marker = os.path.join(os.environ["ASYNCLLM_WORKER_TRACE_DIR"], f"worker-trace-writing-{os.getpid()}")
open(marker, "w").close()
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(1)), daemon=True).start()
print("writing", flush=True)
time.sleep(0.6)
open(sys.argv[1], "w").close()
os.remove(marker)
"""


@pytest.fixture
def tracing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv(envs.WORKER_TRACE_STEPS.name, "0:1")
    monkeypatch.setenv(envs.WORKER_TRACE_DIR.name, str(tmp_path))
    return tmp_path


def _writer(done: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(done)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"writing\n"
    return proc


def test_the_executors_shutdown_waits_for_a_trace_being_written(monkeypatch, tracing: Path) -> None:
    monkeypatch.setattr(executor_module, "_SHUTDOWN_GRACE_S", 0.05)
    executor = Executor.__new__(Executor)  # only what `_stop_workers` reads: no ring, one live worker
    executor._failure, executor._ring, executor._procs = None, None, [_writer(tracing / "done")]
    executor._stop_workers()
    assert (tracing / "done").exists()
    assert not Path(writing_marker(executor._procs[0].pid)).exists()


@pytest.mark.parametrize("pid", ["the worker's", None], ids=["executor", "host"])
def test_wait_for_exit_lasts_while_a_trace_is_written_only(tracing: Path, pid: str | None) -> None:
    proc = _writer(tracing / "done")
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


def test_the_workers_import_nothing_of_bench() -> None:
    folder = Path(executor_module.__file__).parent
    assert [p.name for p in folder.glob("*.py") if "asyncllm.bench" in p.read_text()] == []
