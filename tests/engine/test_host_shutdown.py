"""How a host's shutdown reaches the engine: signals to the host's process group, a cancelled drain, an engine
dropped without aclose() (docs/reliability.md#lifecycle)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.procutil import proc_stat

KWARGS = dict(disable_log_stats=True, max_model_len=128, num_gpu_blocks_override=32)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

_DRAINING_HOST = """
import asyncio, json, os, signal, sys
from asyncllm import AsyncEngine, SamplingParams

async def main():
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    engine = AsyncEngine(sys.argv[1], disable_log_stats=True, max_model_len=128, num_gpu_blocks_override=32)
    await engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    streams = [engine.stream(prompt, params) for prompt in ("def main():", "import os")]
    firsts = [await stream.__anext__() for stream in streams]
    async def rest(stream):
        return [delta async for delta in stream]
    tasks = [asyncio.create_task(rest(stream)) for stream in streams]
    print(engine._core.pid, flush=True)
    await stop.wait()
    await engine.aclose(drain=True, timeout=60)
    results = []
    for first, task in zip(firsts, tasks):
        deltas = [first, *(await task)]
        results.append([deltas[-1].finish_reason, sum(len(d.token_ids) for d in deltas)])
    print(json.dumps(results), flush=True)

asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[0] == "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


def test_ctrl_c_and_sigterm_to_the_group_leave_a_draining_host_its_requests(tiny_llama: str) -> None:
    """Ctrl-C in a terminal and systemd's stop signal the whole process group: the core and its workers (new
    interpreters in the host's group, as users get them) ignore both, and the host's drain finishes every request."""
    env = {name: value for name, value in os.environ.items() if name != "ASYNCLLM_FORKSERVER"}
    host = subprocess.Popen([sys.executable, "-P", "-c", _DRAINING_HOST, tiny_llama], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        core_pid = int(host.stdout.readline())  # type: ignore[union-attr]
        os.killpg(host.pid, signal.SIGTERM)
        os.killpg(host.pid, signal.SIGINT)
        out, err = host.communicate(timeout=60)
    finally:
        if host.poll() is None:
            os.killpg(host.pid, signal.SIGKILL)
    assert host.returncode == 0, err
    assert json.loads(out) == [["length", 24], ["length", 24]]
    assert "Traceback" not in err
    assert _wait_gone(core_pid, 5)


def test_a_cancelled_drain_still_stops_the_core(tiny_llama: str) -> None:
    async def main() -> tuple[list[str | None], bool]:
        engine = AsyncEngine(tiny_llama, **{**KWARGS, "max_model_len": 2048, "num_gpu_blocks_override": 512})
        await engine.start()
        core_pid = engine._core.pid
        longer = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)  # seconds: past any deadline
        streams = [engine.stream(prompt, longer) for prompt in ("def main():", "import os")]
        for stream in streams:
            await stream.__anext__()
        try:
            await asyncio.wait_for(engine.aclose(drain=True), 0.2)  # the host's shutdown deadline
        except asyncio.TimeoutError:
            pass
        finishes = []
        for stream in streams:
            finishes.append([delta async for delta in stream][-1].finish_reason)
        return finishes, engine.started or not _wait_gone(core_pid, 5)

    finishes, running = asyncio.run(main())
    assert finishes == ["abort", "abort"]
    assert not running


def test_an_engine_dropped_without_aclose_stops_its_core(tiny_llama: str) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()

    async def main() -> tuple[bool, bool]:
        engine = AsyncEngine(tiny_llama, **KWARGS, prometheus_registry=registry)
        await engine.generate("def main():", SamplingParams(max_tokens=4, ignore_eos=True))
        core_pid, collected = engine._core.pid, weakref.ref(engine)
        del engine
        await asyncio.sleep(0.1)  # deliveries the processor thread queued on the loop (bound to the engine) run
        gc.collect()
        return collected() is None, await asyncio.to_thread(_wait_gone, core_pid, 5)

    assert asyncio.run(main()) == (True, True)
    for thread in threading.enumerate():  # the finalizer's stop, then its replicas are gone
        if thread.name == "asyncllm-stop-forgotten":
            thread.join(10)
    gc.collect()
    samples = {s.name: s.value for m in registry.collect() for s in m.samples}
    assert samples.get("asyncllm:generation_tokens_total") == 4, samples  # retired as aclose() retires them
