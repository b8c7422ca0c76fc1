"""A host killed with SIGKILL leaves its socket folder; the next host to make one sweeps it (asyncllm/ipc_dirs.py),
and never a live process's folder, another user's, or one whose socket still serves (a core other hosts attach to)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from asyncllm import ipc_dirs, owner_lock

CHILD = "from asyncllm.ipc_dirs import private_ipc_dir; print(private_ipc_dir(), flush=True); input()"


def _killed_host_folder(parent) -> tuple[str, int]:
    """A real child that made its folder in `parent`, then was SIGKILLed (no atexit hook ran): its folder and pid."""
    env = {**os.environ, "ASYNCLLM_RUNTIME_DIR": str(parent)}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    folder = child.stdout.readline().strip()
    assert os.path.isdir(folder) and f"-{child.pid}-" in os.path.basename(folder)
    assert ipc_dirs.sweep_dead_dirs(str(parent)) == [] and os.path.isdir(folder)  # its owner lives: kept
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)
    child.stdin.close()
    child.stdout.close()
    assert os.path.isdir(folder)  # left behind
    return folder, child.pid


def test_a_starting_host_sweeps_the_folder_of_a_killed_one(tmp_path, monkeypatch) -> None:
    folder, _ = _killed_host_folder(tmp_path)
    keep = tmp_path / f"asyncllm-{os.getuid()}"  # `asyncllm engine`'s per-user folder: not a private folder
    keep.mkdir()
    monkeypatch.setenv("ASYNCLLM_RUNTIME_DIR", str(tmp_path))
    mine = ipc_dirs.private_ipc_dir()  # a host starting: it sweeps first
    try:
        assert not os.path.exists(folder) and keep.is_dir() and os.path.isdir(mine)
        assert os.path.basename(mine).startswith(f"asyncllm-{os.getpid()}-")
        assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [] and os.path.isdir(mine)  # its own: alive
    finally:
        ipc_dirs.remove_dir(mine)


def test_a_dead_hosts_folder_whose_socket_serves_is_kept(tmp_path) -> None:
    """A core its killed owner started still serves the hosts attached by its address while it ends."""
    folder, _ = _killed_host_folder(tmp_path)
    path = os.path.join(folder, "s")  # short: an AF_UNIX path holds 107 bytes
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen()
        assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [] and os.path.exists(path)
    assert os.path.exists(path)  # closed: a socket file nothing listens on
    assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [folder] and not os.path.exists(folder)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_another_users_folder_is_kept(tmp_path) -> None:
    folder, _ = _killed_host_folder(tmp_path)
    os.chown(folder, 12345, 12345)
    assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [] and os.path.isdir(folder)


def test_a_folder_gone_mid_sweep_is_skipped(tmp_path, monkeypatch) -> None:
    """Two hosts sweeping at once: the other removed the folder between this one's listing and its look."""
    folder, _ = _killed_host_folder(tmp_path)
    listdir = os.listdir

    def listed_then_removed(parent):
        names = listdir(parent)
        ipc_dirs.remove_dir(folder)
        return names

    monkeypatch.setattr(ipc_dirs.os, "listdir", listed_then_removed)
    assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [] and not os.path.exists(folder)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def test_a_live_owner_whose_pid_reads_dead_keeps_its_folder(tmp_path) -> None:
    """A host in another pid namespace (containers sharing /tmp): its pid reads as dead here, but it holds its
    folder's owner.lock (asyncllm/owner_lock.py) while it lives."""
    folder = tmp_path / f"asyncllm-{_dead_pid()}-beef"
    folder.mkdir(mode=0o700)
    lock = os.open(folder / "owner.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_SH)
        old = time.time() - 3600
        os.utime(folder, (old, old))
        assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [] and folder.is_dir()
    finally:
        os.close(lock)  # the owner ends: its lock goes with it
    assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [str(folder)] and not folder.exists()


def test_a_folder_without_a_lock_goes_once_a_minute_old(tmp_path) -> None:
    """Made by an older asyncllm, or its maker is between mkdir and taking the lock: kept while young."""
    folder = tmp_path / f"asyncllm-{_dead_pid()}-cafe"
    folder.mkdir(mode=0o700)
    assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [] and folder.is_dir()
    old = time.time() - owner_lock.ABANDONED_AFTER_S - 1
    os.utime(folder, (old, old))
    assert ipc_dirs.sweep_dead_dirs(str(tmp_path)) == [str(folder)] and not folder.exists()
