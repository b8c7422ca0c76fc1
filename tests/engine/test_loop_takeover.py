"""A closed event loop's engine taken over by the next loop (docs/reliability.md, Lifecycle), without engines.

A start that loop left pending (closed without cancelling its tasks) is dropped and what it launched stopped, even
what is launched after; a core that died while no loop ran, or whose restart the loop's end cut off, is restarted
by the takeover (max_core_restarts); and a stop's threads run even at interpreter shutdown (an atexit close).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread
import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from asyncllm import AsyncEngine, EngineDeadError
from asyncllm.config import CacheConfig
from asyncllm.engine import off_loop, replica
from asyncllm.engine.launch import CoreProcess
from asyncllm.engine.launched import Launched

KWARGS = dict(disable_log_stats=True, max_model_len=128, num_gpu_blocks_override=32)


def test_a_start_its_loop_closed_on_is_dropped_by_the_next_loop(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A loop stopped and closed while the engine started (``loop.stop()``, Ctrl-C out of ``run_until_complete``)
    left the engine "starting in another event loop" for good, its core running, and aclose() raising "Event loop
    is closed": the next loop drops that start, stopping its processor and core, and starts afresh."""
    prepared = SimpleNamespace(config=SimpleNamespace(cache_config=CacheConfig()), hf_config_json=None)
    monkeypatch.setattr(replica, "prepare", lambda config, resolved=False: prepared)
    spawned: list[subprocess.Popen] = []
    closed: list[bool] = []

    def launch_core(*args: Any) -> CoreProcess:
        spawned.append(subprocess.Popen([sys.executable, "-c", "import os\nwhile os.read(0, 1): pass"],
                                        stdin=subprocess.PIPE))
        return CoreProcess(spawned[-1], "ipc://unused", str(tmp_path / "ipc"))

    processor = SimpleNamespace(start=concurrent.futures.Future, said_goodbye=False,  # never ready
                                close=lambda shutdown_core: closed.append(shutdown_core))
    monkeypatch.setattr(replica, "launch_core", launch_core)
    monkeypatch.setattr(replica, "_processor", lambda *args: processor)
    engine = AsyncEngine(**KWARGS)
    first = asyncio.new_event_loop()
    first.create_task(engine.start())
    first.run_until_complete(asyncio.sleep(0.3))  # the core spawned, its processor waits for Ready
    first.close()
    assert len(spawned) == 1 and spawned[0].poll() is None

    async def second() -> None:
        with pytest.raises(asyncio.TimeoutError):  # not EventLoopError: a start of its own
            await asyncio.wait_for(engine.start(), 0.3)
        await engine.aclose()

    asyncio.run(second())
    assert len(spawned) == 2
    for child in spawned:
        assert child.wait(timeout=3) == 0  # stopped: its stdin closed
    assert closed == [True, True]


def test_the_next_loop_restarts_a_core_that_died_between_loops_or_whose_restart_a_loop_end_cut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor heard of a dead core only from a delivery to the engine's loop: a core that died while no loop
    ran was never restarted (max_core_restarts), nor was one whose restart ``asyncio.run`` ending cancelled. The next
    loop's takeover restarts it; the cut-off restart's retry takes no more from the budget (2 here)."""
    restarts: list[str] = []

    async def restart_replica(self: AsyncEngine, index: int) -> None:
        restarts.append("begun")
        if len(restarts) == 2:  # the first is cut off, the retry serves
            await asyncio.sleep(10)
        self._replicas[index].processor = SimpleNamespace(dead=None)

    monkeypatch.setattr(AsyncEngine, "_restart_replica", restart_replica)
    engine = AsyncEngine(max_core_restarts=2, **KWARGS)
    gone = asyncio.new_event_loop()
    gone.close()
    engine._loop, engine._started = gone, True  # started in a loop that closed; its core died meanwhile
    engine._replicas[0].processor = SimpleNamespace(dead=EngineDeadError("engine core was killed"))

    async def takeover(wait: bool) -> bool:
        engine._check_loop()
        if wait:
            await engine._replicas[0].supervisor.wait()
        return engine.stats().engine_alive

    assert asyncio.run(takeover(wait=True)) and restarts == ["begun"]
    engine._replicas[0].processor = SimpleNamespace(dead=EngineDeadError("engine core was killed"))
    assert not asyncio.run(takeover(wait=False))  # the restart (the budget's last) begins; asyncio.run's end cuts it
    assert asyncio.run(takeover(wait=True)) and restarts == ["begun"] * 3


def test_a_restart_cut_off_after_its_core_started_leaves_no_free_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop's end cancelled a restart after its core started (waiting for the weights' replay): the takeover finds
    the core alive and forgets the cut-off, so the next death takes from the budget (1 here, spent: no restart),
    where a stale flag restarted it for free with a false "restart was cut off" warning."""
    restarts: list[str] = []

    async def restart_replica(self: AsyncEngine, index: int) -> None:
        restarts.append("begun")
        self._replicas[index].processor = SimpleNamespace(dead=None)  # start_replica done: the new core serves
        await asyncio.sleep(10)

    monkeypatch.setattr(AsyncEngine, "_restart_replica", restart_replica)
    engine = AsyncEngine(max_core_restarts=1, **KWARGS)
    gone = asyncio.new_event_loop()
    gone.close()
    engine._loop, engine._started = gone, True
    engine._replicas[0].processor = SimpleNamespace(dead=EngineDeadError("engine core was killed"))

    async def takeover() -> None:
        engine._check_loop()
        engine._replicas[0].check_dead()
        await asyncio.sleep(0)

    asyncio.run(takeover())  # restart 1 (the budget's only one) begins; asyncio.run's end cuts it
    asyncio.run(takeover())  # the core serves: nothing to retry
    engine._replicas[0].processor = SimpleNamespace(dead=EngineDeadError("engine core was killed again"))
    asyncio.run(takeover())
    assert restarts == ["begun"] and engine._replicas[0].supervisor.budget.num_restarts_total == 1


def test_cleanup_in_a_thread_runs_at_interpreter_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() from an atexit handler: asyncio's default executor refuses work once the interpreter exits, so the
    stop raised "cannot schedule new futures after interpreter shutdown" and stopped nothing. Where no thread can
    start at all (Python 3.12+ at shutdown) it runs inline."""
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)  # as at interpreter exit
    done: list[str] = []
    asyncio.run(off_loop.finish_in_thread(lambda: done.append(threading.current_thread().name)))

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(off_loop, "threading", SimpleNamespace(Thread=refused))
    asyncio.run(off_loop.finish_in_thread(lambda: done.append(threading.current_thread().name)))
    assert done == ["asyncllm-<lambda>", "MainThread"]
    # every fire-and-forget stop starts its thread as these do (`off_loop.start_daemon`): inline when none starts
    launched = concurrent.futures.Future()
    launched.set_result("core")
    off_loop._hand_over(launched, lambda core: done.append(f"{core} in {threading.current_thread().name}"))
    processor = SimpleNamespace(close=lambda shutdown_core: done.append(threading.current_thread().name),
                                said_goodbye=True)
    orphaned = SimpleNamespace(supervisor=SimpleNamespace(drop_orphaned=lambda: None), launching=None,
                               processor=processor, core=None)
    replica.Replica.drop_orphaned(orphaned, started=False)  # a takeover's stop of what a closed loop launched
    assert done[2:] == ["core in MainThread", "MainThread"] and orphaned.processor is None


def test_a_core_launched_after_its_start_was_dropped_stops_itself() -> None:
    """A takeover dropped a start whose core spawn was under way: the core it returns is cut at once."""
    launched, stopped = Launched(), []
    assert launched.drop() == (None, None)
    core = SimpleNamespace(stop=lambda told: stopped.append(told))
    assert launched.core(lambda: core) is core and stopped == [False]
