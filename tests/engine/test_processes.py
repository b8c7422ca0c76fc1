"""No process outlives the engine: after aclose(), and after the host is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from asyncllm import AsyncEngine, SamplingParams
from proc_utils import children, worker_pids


SPAWN_PROCESSES = True  # checks the process tree under the host and the core: new interpreters, not the test fork server (tests/conftest.py)

def _children(pid: int) -> set[int]:
    """All descendants of `pid`, read from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


async def test_aclose_ends_core_and_workers(tiny_llama: str) -> None:
    engine = AsyncEngine(tiny_llama, tensor_parallel_size=2, disable_log_stats=True, max_model_len=256)
    async with engine:
        await engine.generate([4, 5, 6], SamplingParams(max_tokens=2))
        core_pid = engine._core.pid
        procs = {core_pid} | _children(core_pid)  # this engine's (other tests' engines may still be alive)
        ipc_dir = engine._core.ipc_dir
        assert len(procs) >= 3  # the core and two workers
    assert _wait_gone(procs, 10) == set()
    assert not os.path.exists(ipc_dir)


HOST_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from asyncllm import AsyncEngine, SamplingParams

    async def main():
        engine = AsyncEngine(sys.argv[1], tensor_parallel_size=2, disable_log_stats=True, max_model_len=256)
        await engine.start()
        print("ready", flush=True)
        while True:
            async for _ in engine.stream([4, 5, 6], SamplingParams(max_tokens=200, ignore_eos=True)):
                pass

    asyncio.run(main())
    """
)


def test_killed_host_leaves_no_process_even_a_hung_core_and_worker(tiny_llama: str) -> None:
    """The core and one worker are stopped first: like a process hung holding the GIL, they run no watcher thread
    of their own, and the kernel's parent-death signal ends them (`procutil.die_with_parent`), though the host
    started its core from an asyncio.to_thread thread (`off_loop.in_thread`) that may end before the host."""
    host = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, tiny_llama], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        procs = _children(host.pid)
        (core,) = {pid for pid in procs if pid in children(host.pid)}
        workers = worker_pids(core)
        assert len(workers) == 2
        for pid in (core, workers[0]):
            os.kill(pid, signal.SIGSTOP)
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    assert _wait_gone(procs, 3) == set()
