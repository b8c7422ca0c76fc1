"""The fork server (asyncllm/forkserver.py, asyncllm/forked_process.py): a forked child gets the caller's arguments,
directory, environment and stdout, lives until its stdin pipe closes and reports its exit status like `Popen`; a
caller whose start-up variables differ, or a server that is gone, gets a new interpreter; a bad caller or many
listings leave the server serving; a child dies with its server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import textwrap
import time

import pytest

from asyncllm import forked_process, forkserver, procutil

PROBE = textwrap.dedent("""
    import os, signal, sys
    print("probe", os.environ["PROBE"], sys.argv[1:], os.getcwd(), signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
          flush=True)
    sys.stdin.buffer.read()  # until the caller closes the pipe (or dies)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """(address, the server process, its PYTHONPATH): a server of its own that can import the probe module."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "fs_probe.py").write_text(PROBE)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    try:
        address = str(folder / "server.sock")
        proc = forkserver.start_server(address)
    finally:
        os.environ.pop("PYTHONPATH") if before is None else os.environ.__setitem__("PYTHONPATH", before)
    yield address, proc, path
    procutil.stop_process(proc)


def _env(server, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": server[2], **extra}


def test_child_runs_with_the_callers_arguments_directory_environment_and_stdout(server, tmp_path, capfd,
                                                                                  monkeypatch) -> None:
    address = server[0]
    monkeypatch.chdir(tmp_path)
    child = forked_process.fork_module(address, "fs_probe", ["7", "x y"], _env(server, PROBE="seen"))
    assert {child.pid: (os.getpid(), "fs_probe")}.items() <= forked_process.children(address).items()
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.3)  # blocked on its stdin pipe
    assert child.poll() is None
    child.stdin.close()
    assert child.wait(timeout=30) == 7 and child.returncode == 7
    assert f"probe seen ['7', 'x y'] {tmp_path} True" in capfd.readouterr().out  # SIGPIPE ignored, as a new one
    assert child.pid not in forked_process.children(address)


def test_killed_child_reports_the_signal_and_stop_process_ends_a_child(server) -> None:
    child = forked_process.fork_module(server[0], "fs_probe", ["0"], _env(server, PROBE="p"))
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.kill()  # after the exit: nothing to signal, no error
    other = forked_process.fork_module(server[0], "fs_probe", ["5"], _env(server, PROBE="p"))
    procutil.stop_process(other)  # closes its stdin: the probe exits with its own code
    assert other.returncode == 5


def test_spawn_module_forks_when_the_variable_names_a_server(server, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCLLM_FORKSERVER", server[0])
    monkeypatch.setenv("PYTHONPATH", server[2])
    monkeypatch.setenv("PROBE", "from-env")
    child = procutil.spawn_module("fs_probe", ["3"], {"EXTRA": "1"})
    assert isinstance(child, forked_process.ForkedProcess)
    procutil.stop_process(child)
    assert child.returncode == 3


def test_other_startup_variables_are_refused_and_get_a_new_interpreter(server, monkeypatch) -> None:
    with pytest.raises(forked_process.ForkRefused, match="TORCH_LOGS"):
        forked_process.fork_module(server[0], "fs_probe", ["0"], _env(server, PROBE="p", TORCH_LOGS="+dynamo"))
    monkeypatch.setenv("ASYNCLLM_FORKSERVER", server[0])
    child = procutil.spawn_module("fs_probe", ["6"], {"PYTHONPATH": server[2], "PROBE": "p", "TORCH_LOGS": "+dynamo"})
    assert isinstance(child, subprocess.Popen)
    procutil.stop_process(child)
    assert child.returncode == 6


def test_an_unreachable_server_falls_back_to_a_new_interpreter(server, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCLLM_FORKSERVER", str(tmp_path / "gone.sock"))
    child = procutil.spawn_module("fs_probe", ["4"], {"PYTHONPATH": server[2], "PROBE": "p"})
    assert isinstance(child, subprocess.Popen)
    procutil.stop_process(child)
    assert child.returncode == 4


def test_bad_requests_and_listings_leave_the_server_serving_without_leaking(server) -> None:
    address, proc = server[0], server[1]
    fds = lambda: len(os.listdir(f"/proc/{proc.pid}/fd"))  # noqa: E731
    before = fds()
    for body in (b"\x00" * 8 + b"", forked_process.LEN.pack(3) + b"\xc1\xc1\xc1"):  # empty, then not msgpack
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(address)
            socket.send_fds(conn, [body], [0, 1, 2])
            conn.recv(1)  # the server closes it
    for _ in range(20):
        forked_process.children(address)
    deadline = time.monotonic() + 5
    while fds() != before and time.monotonic() < deadline:  # the last listing's connection closes after its reply
        time.sleep(0.01)
    assert fds() == before and proc.poll() is None


def test_a_child_dies_with_its_server_and_reports_it(server) -> None:
    """Last: it kills the module's server."""
    child = forked_process.fork_module(server[0], "fs_probe", ["0"], _env(server, PROBE="p"))
    server[1].kill()
    start = time.monotonic()
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert time.monotonic() - start < 10
    assert not os.path.exists(f"/proc/{child.pid}/status") or "Z" in open(f"/proc/{child.pid}/status").read()


def test_the_startup_variables_are_those_read_before_a_child_runs() -> None:
    env = {"PYTORCH_JIT": "0", "ATEN_CPU_CAPABILITY": "default", "NPY_DISABLE_CPU_FEATURES": "AVX512F",
           "KMP_AFFINITY": "x", "GLIBC_TUNABLES": "y", "PYTHONHASHSEED": "1", "LANG": "C",
           "PYTEST_XDIST_WORKER": "gw0", "ASYNCLLM_CPU_KVCACHE_SPACE_GB": "1", "HF_HOME": "/h", "CUDA_VISIBLE_DEVICES": "0"}
    assert set(forked_process.startup_env(env)) == {"PYTORCH_JIT", "ATEN_CPU_CAPABILITY", "NPY_DISABLE_CPU_FEATURES",
                                                    "KMP_AFFINITY", "GLIBC_TUNABLES", "PYTHONHASHSEED", "LANG"}


def test_a_server_a_host_started_outlives_sigterm_to_the_group(tmp_path) -> None:
    """systemd's stop signals the whole group: the host drains its cores, forked by this server, then closes it."""
    proc = forkserver.start_server(str(tmp_path / "own.sock"))
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    alive = proc.poll() is None
    procutil.stop_process(proc)  # closes its stdin: that ends it
    assert alive and proc.returncode == 0
