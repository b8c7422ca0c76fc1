"""Engine lifecycle: drain or abort on aclose, nothing left behind, no signal handlers, any thread, any loop.

Two engines run one after the other in a plain thread, each under its own
``asyncio.run``: the first closes with ``drain=True`` (in-flight streams
finish, new requests are refused), the second with the default abort. After
both (the second's drain times out, so its stream is aborted), the process has the file descriptors and
children it had before, no shared-memory segment of either core is left, the
second engine left no thread the first did not (the first use of a tokenizer
or of torch starts thread pools that stay), and no signal handler changed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

from asyncllm import AsyncEngine, EngineDeadError, SamplingParams
from proc_utils import children

PROMPTS = ["def main():", "import os\n", "class Config:"]
KWARGS = dict(disable_log_stats=True, max_model_len=128, num_gpu_blocks_override=32)
SPAWN_PROCESSES = True  # checks the host's children return to what they were: new interpreters, not the test fork server (tests/conftest.py)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _signal_handlers() -> dict[int, Any]:
    handlers = {}
    for sig in signal.valid_signals():
        try:
            handlers[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
    return handlers


def _resources() -> dict[str, Any]:
    """What an engine could leak: threads (Python and native), fds, children."""
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "children": children(os.getpid()),
    }


def _settled_thread_count(quiet_s: float = 1.0, timeout: float = 15.0) -> int:
    """The thread count once it stopped changing for `quiet_s` (closing engines' threads take a moment to end)."""
    deadline = time.monotonic() + timeout
    count, since = len(os.listdir("/proc/self/task")), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.05)
        now = len(os.listdir("/proc/self/task"))
        if now != count:
            count, since = now, time.monotonic()
    return count


def _shm_segments_of(pids: list[int]) -> list[str]:
    """/dev/shm segments made by these processes (the ring writer names them asyncllm-PID-...)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return [n for n in names if any(n.startswith(f"asyncllm-{pid}-") for pid in pids)]


async def _drain(model: str) -> dict[str, Any]:
    engine = AsyncEngine(model, **KWARGS)
    await engine.start()
    ipc_dir, core_pid = engine._core.ipc_dir, engine._core.pid
    streams = [engine.stream(p, LONG) for p in PROMPTS]
    firsts = [await s.__anext__() for s in streams]  # all three in flight
    closing = asyncio.create_task(engine.aclose(drain=True, timeout=60))
    await asyncio.sleep(0)
    refused = None
    try:
        await engine.generate("late", LONG)
    except EngineDeadError as exc:
        refused = str(exc)
    rests = []
    for stream in streams:
        rests.append([d async for d in stream])
    await closing
    deltas = [[first, *rest] for first, rest in zip(firsts, rests)]
    return {
        "refused": refused,
        "finish": [d[-1].finish_reason for d in deltas],
        "num_tokens": [sum(len(x.token_ids) for x in d) for d in deltas],
        "ipc_dir_left": os.path.exists(ipc_dir),
        "core_pid": core_pid,
    }


async def _abort(model: str) -> dict[str, Any]:
    engine = AsyncEngine(model, **KWARGS)
    async with engine:
        core_pid = engine._core.pid
        stream = engine.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        first = await stream.__anext__()
        await engine.aclose(drain=True, timeout=0.05)  # the drain times out: what is left is aborted
        rest = [d async for d in stream]
    return {"core_pid": core_pid, "finish": rest[-1].finish_reason if rest else first.finish_reason,
            "num_tokens": len(first.token_ids) + sum(len(d.token_ids) for d in rest)}


def test_two_engines_in_a_thread_under_asyncio_run_twice_leave_nothing_behind(tiny_llama: str) -> None:
    handlers = _signal_handlers()
    before = _resources()
    results: dict[str, Any] = {}

    def main() -> None:
        try:
            results["drain"] = asyncio.run(_drain(tiny_llama))
            results["threads_between"] = _settled_thread_count()
            results["abort"] = asyncio.run(_abort(tiny_llama))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results["error"] = exc

    thread = threading.Thread(target=main, name="engine-host")
    thread.start()
    thread.join(timeout=240)
    assert not thread.is_alive() and "error" not in results, results.get("error")

    drain = results["drain"]
    assert drain["refused"] is not None and "closing" in drain["refused"]
    assert drain["finish"] == ["length"] * 3 and drain["num_tokens"] == [40] * 3  # drained, not aborted
    assert not drain["ipc_dir_left"]
    abort = results["abort"]
    assert abort["finish"] == "abort" and 1 <= abort["num_tokens"] < 100

    assert _signal_handlers() == handlers
    assert _shm_segments_of([drain["core_pid"], abort["core_pid"]]) == []
    deadline = time.monotonic() + 10
    def fds_and_children() -> tuple[int, set[int]]:
        now = _resources()
        return now["fds"], now["children"]

    while time.monotonic() < deadline and fds_and_children() != (before["fds"], before["children"]):
        time.sleep(0.1)  # exiting children take a moment
    assert fds_and_children() == (before["fds"], before["children"])
    assert _settled_thread_count() == results["threads_between"] - 1  # "between" counted the engine-host thread
