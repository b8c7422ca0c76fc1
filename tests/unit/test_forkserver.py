"""The test fork server (asyncllm/forkserver.py): a forked child gets the caller's arguments, directory,
environment and stdout, lives until its stdin pipe closes, and reports its exit status like `Popen`."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import pytest

from asyncllm import forkserver, procutil

PROBE = textwrap.dedent("""
    import os, sys
    print("probe", os.environ["PROBE"], sys.argv[1:], os.getcwd(), flush=True)
    sys.stdin.buffer.read()  # until the caller closes the pipe (or dies)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A server of its own that can import the probe module (PYTHONPATH is the server's)."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "fs_probe.py").write_text(PROBE)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), before]))
    try:
        address = str(folder / "server.sock")
        proc = forkserver.start_server(address)
    finally:
        os.environ.pop("PYTHONPATH") if before is None else os.environ.__setitem__("PYTHONPATH", before)
    yield address
    procutil.stop_process(proc)


@pytest.fixture(scope="module")
def probe_path(server) -> str:
    return os.path.dirname(server)


def test_child_runs_with_the_callers_arguments_directory_environment_and_stdout(server, tmp_path, capfd,
                                                                                  monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    child = forkserver.fork_module(server, "fs_probe", ["7", "x y"], {**os.environ, "PROBE": "seen"})
    assert {child.pid: (os.getpid(), "fs_probe")}.items() <= forkserver.children(server).items()
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.3)  # blocked on its stdin pipe
    assert child.poll() is None
    child.stdin.close()
    assert child.wait(timeout=30) == 7 and child.returncode == 7
    assert f"probe seen ['7', 'x y'] {tmp_path}" in capfd.readouterr().out
    assert child.pid not in forkserver.children(server)


def test_killed_child_reports_the_signal_and_stop_process_ends_a_child(server) -> None:
    child = forkserver.fork_module(server, "fs_probe", ["0"], {**os.environ, "PROBE": "p"})
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.kill()  # after the exit: nothing to signal, no error
    other = forkserver.fork_module(server, "fs_probe", ["5"], {**os.environ, "PROBE": "p"})
    procutil.stop_process(other)  # closes its stdin: the probe exits with its own code
    assert other.returncode == 5


def test_spawn_module_forks_when_the_variable_names_a_server(server, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCLLM_FORKSERVER", server)
    monkeypatch.setenv("PROBE", "from-env")
    child = procutil.spawn_module("fs_probe", ["3"], {"EXTRA": "1"})
    assert isinstance(child, forkserver.ForkedProcess)
    start = time.monotonic()
    procutil.stop_process(child)
    assert child.returncode == 3 and time.monotonic() - start < 10


def test_an_unreachable_server_falls_back_to_a_new_interpreter(probe_path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCLLM_FORKSERVER", str(tmp_path / "gone.sock"))
    child = procutil.spawn_module("fs_probe", ["4"], {"PYTHONPATH": probe_path, "PROBE": "p"})
    assert isinstance(child, subprocess.Popen)
    procutil.stop_process(child)
    assert child.returncode == 4
