"""The core supervisor (`max_core_restarts`, asyncllm/engine/supervisor.py) told of one death more than once, in
process with fake processors: a death past the budget is logged once, not once per delivery of another replica (a
data-parallel engine logged an ERROR line per step of the live replica); a failed restart is not tried again for the
same death (docs/reliability.md: the engine stays dead); and a request picked after a core died, before the loop
was delivered the death (a control call failed by it first), waits for the restart instead of failing; and
`aclose()` cancels a restart in progress instead of waiting for its model load, while `aclose(drain=True)` waits
for the requests that wait for it."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from asyncllm.engine.admission import HostAdmission
from asyncllm.engine.replica import Replica, ReplicaSet
from asyncllm.engine.supervisor import CoreSupervisor
from asyncllm.metrics.observer import RequestObserver


async def test_a_death_past_the_budget_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    restarts: list[int] = []
    supervisor = CoreSupervisor(1, lambda: asyncio.sleep(0, restarts.append(1)))
    supervisor.on_core_dead(RuntimeError("killed"))
    await supervisor.wait()
    second = RuntimeError("killed again")
    with caplog.at_level(logging.ERROR, "asyncllm.engine"):
        for _ in range(50):  # every delivery of the other replicas tells it again
            supervisor.on_core_dead(second)
    assert restarts == [1] and sum("stays dead" in r.getMessage() for r in caplog.records) == 1


async def test_a_failed_restart_is_not_tried_again_for_the_same_death() -> None:
    tries: list[int] = []

    async def restart() -> None:
        tries.append(1)
        raise RuntimeError("no core")

    supervisor = CoreSupervisor(3, restart)
    death = RuntimeError("killed")
    for _ in range(3):
        supervisor.on_core_dead(death)
        await supervisor.wait()
    assert tries == [1] and supervisor.budget.num_restarts_total == 1


async def test_a_request_picked_before_the_death_was_delivered_waits_for_the_restart() -> None:
    replica = Replica(0, RequestObserver("m"), HostAdmission(None, None), None)  # type: ignore[arg-type]
    new = SimpleNamespace(dead=None)

    async def restart() -> None:
        await asyncio.sleep(0.05)
        replica.processor = new  # type: ignore[assignment]

    replica.supervisor = CoreSupervisor(1, restart)
    replica.processor = SimpleNamespace(dead=RuntimeError("engine core was killed"))  # type: ignore[assignment]
    replicas = ReplicaSet([replica])  # no delivery told the loop yet: no restart under way
    assert await replicas.pick(None) is replica and replica.processor is new
    assert replica.supervisor.budget.num_restarts_total == 1


class _DeadProcessor:
    """A processor thread whose core died: closed by the engine's stop."""

    said_goodbye = False

    def __init__(self) -> None:
        self.dead = RuntimeError("engine core was killed")
        self.closed = False

    def close(self, shutdown_core: bool) -> None:
        self.closed = True


async def test_aclose_cancels_a_core_restart_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """A close during a core restart stops it as it stops a start (what it launched stopped: start_replica's cancel)
    and returns at once, where it waited for the new core to load its model (the tiny model's 4 s here, minutes for
    a large one), the other replicas' streams running on meanwhile."""
    import weakref

    from asyncllm import AsyncEngine

    steps: list[str] = []

    async def restart_replica(self: AsyncEngine, index: int) -> None:
        steps.append("began")
        try:
            await asyncio.sleep(60)  # the new core loads its model
        except asyncio.CancelledError:
            steps.append("cancelled")
            raise

    monkeypatch.setattr(AsyncEngine, "_restart_replica", restart_replica)
    engine = AsyncEngine(max_core_restarts=1, disable_log_stats=True, max_model_len=128)
    engine._loop, engine._started = asyncio.get_running_loop(), True  # started; then its core died
    engine._forgotten = weakref.finalize(engine, lambda: None)
    dead = engine._replicas[0].processor = _DeadProcessor()  # type: ignore[assignment]
    engine._replicas[0].check_dead()
    await asyncio.sleep(0)
    assert engine._replicas[0].supervisor.restarting and steps == ["began"]
    await asyncio.wait_for(engine.aclose(), 5)
    assert steps == ["began", "cancelled"] and dead.closed and engine.is_stopped


class _LiveProcessor(_DeadProcessor):
    def __init__(self) -> None:
        super().__init__()
        self.dead = None  # type: ignore[assignment]


async def test_a_drain_waits_for_the_requests_that_wait_for_a_core_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """aclose(drain=True) during a core restart: a request in flight (its call entered, waiting for the new core) is
    waited for, up to the drain's timeout, where the drain returned at once (no core alive) and aborted it."""
    import weakref

    from asyncllm import AsyncEngine

    async def restart_replica(self: AsyncEngine, index: int) -> None:
        await asyncio.sleep(0.3)  # the new core loads
        self._replicas[index].processor = _LiveProcessor()  # type: ignore[assignment]

    monkeypatch.setattr(AsyncEngine, "_restart_replica", restart_replica)
    engine = AsyncEngine(max_core_restarts=1, disable_log_stats=True, max_model_len=128)
    engine._loop, engine._started = asyncio.get_running_loop(), True
    engine._forgotten = weakref.finalize(engine, lambda: None)
    engine._replicas[0].processor = _DeadProcessor()  # type: ignore[assignment]
    engine._replicas[0].check_dead()
    served: list[bool] = []

    async def request() -> None:  # its call's entry, then the pick that waits for the restart
        with engine._drain.request():
            replica = await engine._replicas.pick(None)
            served.append(replica.alive)

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0)
    await asyncio.wait_for(engine.aclose(drain=True, timeout=10), 5)
    await task
    assert served == [True]
