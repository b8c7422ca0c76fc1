"""Process helpers for engine tests, read from /proc: children of a process, and a core's workers."""

from __future__ import annotations

import os

__all__ = ["children", "worker_pids"]


def _live_processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every live (not zombie) process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(entry)] = (int(fields[1]), cmdline)
    return found


def children(pid: int) -> set[int]:
    """The live direct children of `pid`."""
    return {child for child, (parent, _) in _live_processes().items() if parent == pid}


def worker_pids(core_pid: int) -> list[int]:
    """The worker processes of an engine core: its children running asyncllm.workers.worker, or those the
    fork server (tests/conftest.py) forked when the core asked."""
    live = _live_processes()
    spawned = {child for child, (parent, cmdline) in live.items()
               if parent == core_pid and b"asyncllm.workers.worker" in cmdline}
    server = os.environ.get("ASYNCLLM_FORKSERVER")
    if server:
        from asyncllm import forked_process

        spawned |= {child for child, (caller, module) in forked_process.children(server).items()
                    if caller == core_pid and module == "asyncllm.workers.worker" and child in live}
    return sorted(spawned)
