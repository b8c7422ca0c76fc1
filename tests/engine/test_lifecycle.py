"""Engine lifecycle: drain or abort on aclose, nothing left behind, no signal handlers, any thread, any loop.

Two engines run one after the other in a plain thread, each under its own
``asyncio.run``: the first closes with ``drain=True`` (in-flight streams
finish, new requests are refused), the second with the default abort. After
both (the second's drain times out, so its stream is aborted), the process has the file descriptors and
children it had before, no shared-memory segment of either core is left, the
second engine left no thread the first did not (the first use of a tokenizer
or of torch starts thread pools that stay), and no signal handler changed.

Without processes: aclose() during start(), one prepare at a time, and a cancelled start's quick, quiet stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncllm import AsyncEngine, EngineDeadError, SamplingParams
from asyncllm.engine import async_engine, replica
from asyncllm.engine import prepare as prepare_module
from asyncllm.engine.launch import CoreProcess
from asyncllm.engine.processor import Processor
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


def test_aclose_during_start_waits_and_the_start_stops_what_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """aclose() returned at once and the start then finished, leaving the core running: now aclose waits for the
    start, which stops its replicas and raises (no processes here: the replicas' start and stop are stand-ins)."""
    stopped: list[list[Any]] = []

    async def start_replicas(replicas: list[replica.Replica], config: Any, spec: Any) -> Any:
        await asyncio.sleep(0.2)
        for started in replicas:
            started.processor = "processor"
        return SimpleNamespace(config=config, pooling_model=None, default_sampling={}, tokenizer=None, mm=None,
                               generation_config={}, vocab_size=1, eos_token_ids=[])

    monkeypatch.setattr(async_engine, "start_replicas", start_replicas)
    monkeypatch.setattr(async_engine, "stop_replicas", lambda replicas: stopped.append([r.processor for r in replicas]))

    async def main() -> AsyncEngine:
        engine = AsyncEngine(**KWARGS)
        start = asyncio.create_task(engine.start())
        await asyncio.sleep(0.05)
        await engine.aclose()
        assert start.done()
        with pytest.raises(EngineDeadError, match="closed while starting"):
            await start
        return engine

    engine = asyncio.run(main())
    assert stopped == [["processor"]] and engine._processor is None and not engine.started


def test_prepares_run_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' lazy imports are not thread-safe: two engines preparing at once got "cannot import name
    'AutoConfig' from 'transformers'"."""
    running, most = [0], [0]

    def one_prepare(config: Any) -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.05)
        running[0] -= 1

    monkeypatch.setattr(prepare_module, "_prepare", one_prepare)
    threads = [threading.Thread(target=prepare_module.prepare, args=(None,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1


def test_a_cancelled_start_stops_at_once_and_quietly(tmp_path: Any) -> None:
    """``asyncio.wait_for(engine.start(), T)``: the processor thread's ready future was cancelled (its setting it
    raised InvalidStateError, logged), and a core never told Goodbye had its 10 s grace before its stdin closed."""
    ready: concurrent.futures.Future = concurrent.futures.Future()
    ready.cancel()
    Processor._settle_ready(SimpleNamespace(ready=ready), EngineDeadError("engine closed while starting"))

    child = subprocess.Popen([sys.executable, "-c", "import os\nwhile os.read(0, 1): pass"], stdin=subprocess.PIPE)
    processor = SimpleNamespace(said_goodbye=False, close=lambda shutdown_core: None)
    began = time.monotonic()
    replica._stop(processor, CoreProcess(child, "ipc://unused", str(tmp_path / "ipc")))  # type: ignore[arg-type]
    assert time.monotonic() - began < 3 and child.returncode == 0
