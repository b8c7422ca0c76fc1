"""Engine lifecycle: drain or abort on aclose, nothing left behind, no signal handlers, any thread, any loop.

Two engines run one after the other in a plain thread, each under its own
``asyncio.run``: the first closes with ``drain=True`` (in-flight streams
finish, new requests are refused), the second with the default abort. After
both (the second's drain times out, so its stream is aborted), the process has the file descriptors and
children it had before, no shared-memory segment of either core is left, the
second engine left no thread the first did not (the first use of a tokenizer
or of torch starts thread pools that stay), and no signal handler changed.

Without engines (stand-ins for prepare and launch): aclose() during start(), a cancelled start's quick, quiet stop of
what it launched, a failed start's retry from another loop, prepares in parallel (and, in a fresh process, their
transformers imports one at a time) (a closed loop's takeover: test_loop_takeover.py).
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
from asyncllm.engine import off_loop, replica
from asyncllm.engine import prepare as prepare_module
from asyncllm.engine.launch import CoreProcess
from asyncllm.engine.launched import stop_launched
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


def _stand_in_prepare(monkeypatch: pytest.MonkeyPatch, wait: threading.Event | None = None) -> list[str]:
    """`replica.prepare` blocks until `wait` is set (a download); `replica.launch_core` records its call."""
    launched: list[str] = []

    def prepare(config: Any, resolved: bool = False) -> Any:
        if wait is not None:
            wait.wait(3)
        return SimpleNamespace(config=config, hf_config_json=None)

    monkeypatch.setattr(replica, "prepare", prepare)
    monkeypatch.setattr(replica, "launch_core", lambda *args: launched.append("core"))
    return launched


def test_aclose_during_start_stops_the_start_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """aclose() during a start waited for the whole start (a download, up to the startup timeout): now it cancels
    the start, whose prepare thread runs on unheeded; the start raises and nothing was launched."""
    download = threading.Event()
    launched = _stand_in_prepare(monkeypatch, download)

    async def main() -> tuple[float, BaseException, AsyncEngine]:
        engine = AsyncEngine(**KWARGS)
        start = asyncio.create_task(engine.start())
        await asyncio.sleep(0.05)
        began = time.monotonic()
        await engine.aclose()
        took = time.monotonic() - began
        return took, (await asyncio.gather(start, return_exceptions=True))[0], engine

    took, error, engine = asyncio.run(main())
    download.set()
    assert took < 1
    assert isinstance(error, EngineDeadError) and "closed while starting" in str(error)
    assert launched == [] and engine._processor is None and not engine.started


def test_a_cancelled_start_stops_the_core_launched_after_the_cancel(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Any) -> None:
    """``asyncio.wait_for(engine.start(), T)`` during `launch_core`: the start returned on time and its thread then
    spawned a core that nobody stopped (anyio's shield does not hold off a plain asyncio cancel)."""
    _stand_in_prepare(monkeypatch)
    spawned: list[subprocess.Popen] = []

    def launch_core(*args: Any) -> CoreProcess:
        time.sleep(0.3)  # the spawn (a fork server's round trip, a slow disk)
        spawned.append(subprocess.Popen([sys.executable, "-c", "import os\nwhile os.read(0, 1): pass"],
                                        stdin=subprocess.PIPE))
        return CoreProcess(spawned[-1], "ipc://unused", str(tmp_path / "ipc"))

    monkeypatch.setattr(replica, "launch_core", launch_core)

    async def main() -> float:
        began = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(AsyncEngine(**KWARGS).start(), 0.1)
        return time.monotonic() - began

    assert asyncio.run(main()) < 0.25
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not (spawned and spawned[0].poll() is not None):
        time.sleep(0.02)
    assert spawned and spawned[0].returncode == 0  # stopped: its stdin closed


def test_a_failed_start_leaves_the_engine_to_any_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed start left the engine bound to its loop: a retry from another open loop raised EventLoopError though
    nothing ran."""
    def prepare(config: Any, resolved: bool = False) -> Any:
        raise RuntimeError("stand-in prepare failed")

    monkeypatch.setattr(replica, "prepare", prepare)
    engine = AsyncEngine(**KWARGS)
    first = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match="stand-in"):
            first.run_until_complete(engine.start())
        with pytest.raises(RuntimeError, match="stand-in"):  # not EventLoopError: the first loop is still open
            asyncio.run(engine.start())
    finally:
        first.close()


def test_prepares_run_in_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preparation ran one at a time: an engine whose model is cached waited out another's download."""
    together = threading.Barrier(3, timeout=2)
    broken: list[BaseException] = []

    passed: list[int] = []

    def one_prepare(config: Any, decodes_images: bool) -> None:
        try:
            passed.append(together.wait())
        except threading.BrokenBarrierError as exc:
            broken.append(exc)

    monkeypatch.setattr(prepare_module, "import_transformers", lambda: None)
    monkeypatch.setattr(prepare_module, "_prepare", one_prepare)
    threads = [threading.Thread(target=prepare_module.prepare, args=(None, True)) for _ in range(3)]  # resolved: no revision check
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert broken == [] and sorted(passed) == [0, 1, 2]


_CONCURRENT_PREPARES = """
import sys, threading
from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import prepare
config = EngineConfig.create(sys.argv[1], max_model_len=128)
together, errors = threading.Barrier(8), []
def one():
    together.wait()
    try:
        prepare(config)
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=one) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(sorted(m for m in sys.modules if m.endswith(("processing_auto", "feature_extraction_auto"))))
print(errors)
"""


def test_concurrent_prepares_in_a_fresh_process_import_transformers_safely(tiny_llama: str, tmp_path: Any) -> None:
    """transformers' lazy imports are not thread-safe: eight engines preparing at once in a process that had not
    imported transformers got "cannot import name 'AutoConfig' from 'transformers'" (`import_transformers`). A
    text-only model's host imports no image or audio processors (their modules pull torch._dynamo, scipy and their
    side effects in)."""
    done = subprocess.run([sys.executable, "-c", _CONCURRENT_PREPARES, tiny_llama], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == ["[]", "[]"]  # no processor modules; no errors


def test_a_cancelled_start_stops_at_once_and_quietly(tmp_path: Any) -> None:
    """``asyncio.wait_for(engine.start(), T)``: the processor thread's ready future was cancelled (its setting it
    raised InvalidStateError, logged), and a core never told Goodbye had its 10 s grace before its stdin closed."""
    ready: concurrent.futures.Future = concurrent.futures.Future()
    ready.cancel()
    Processor._settle_ready(SimpleNamespace(ready=ready), EngineDeadError("engine closed while starting"))

    child = subprocess.Popen([sys.executable, "-c", "import os\nwhile os.read(0, 1): pass"], stdin=subprocess.PIPE)
    processor = SimpleNamespace(said_goodbye=False, close=lambda shutdown_core: None)
    began = time.monotonic()
    stop_launched(processor, CoreProcess(child, "ipc://unused", str(tmp_path / "ipc")))  # type: ignore[arg-type]
    assert time.monotonic() - began < 3 and child.returncode == 0


async def test_cleanup_in_a_thread_finishes_through_repeated_cancels() -> None:
    """anyio's shield did not hold off a plain asyncio cancel: a start cancelled by wait_for, then by aclose(),
    returned while its stop still ran unawaited (`finish_in_thread`)."""
    stopped = threading.Event()

    def stop() -> None:
        time.sleep(0.3)
        stopped.set()

    task = asyncio.ensure_future(off_loop.finish_in_thread(stop))
    for _ in range(2):
        await asyncio.sleep(0.05)
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stopped.is_set()


def test_an_abandoned_result_is_stopped_in_a_thread_of_its_own() -> None:
    """A launch that finished just before its cancel: stopping its core (seconds) ran on the event loop."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result("core")
    ran = concurrent.futures.Future()
    off_loop._hand_over(done, lambda core: ran.set_result((core, threading.current_thread().name)))
    assert ran.result(timeout=2) == ("core", "asyncllm-abandoned")


def test_after_a_failed_start_another_loop_may_start_it_contended(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start lock of the failed loop stayed: two starts from the next loop raised "bound to a different event
    loop"."""
    def prepare(config: Any, resolved: bool = False) -> Any:
        time.sleep(0.05)
        raise RuntimeError("stand-in prepare failed")

    monkeypatch.setattr(replica, "prepare", prepare)
    engine = AsyncEngine(**KWARGS)

    async def two_starts() -> list[BaseException | None]:
        return await asyncio.gather(engine.start(), engine.start(), return_exceptions=True)

    for _ in range(2):
        results = asyncio.run(two_starts())
        assert all(isinstance(r, RuntimeError) and "stand-in" in str(r) for r in results), results


def test_starts_of_one_loop_run_one_at_a_time_after_a_failed_one() -> None:
    """A failed start dropped the start lock while a second start waited on it: a third made a new lock and two
    starts ran at once (each launching cores onto the same replicas)."""
    engine = AsyncEngine(**KWARGS)
    active, peak = 0, 0

    async def start_replicas() -> Any:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            await asyncio.sleep(0.05)
            raise RuntimeError("stand-in start failed")
        finally:
            active -= 1

    engine._start_replicas = start_replicas  # type: ignore[method-assign]

    async def three_starts() -> list[BaseException | None]:
        first, second = asyncio.ensure_future(engine.start()), asyncio.ensure_future(engine.start())
        await asyncio.sleep(0.08)  # the first failed, the second is starting
        return await asyncio.gather(first, second, engine.start(), return_exceptions=True)

    results = asyncio.run(three_starts())
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert peak == 1

