"""Control calls across engine faults, in process with fake replicas: the shared-memory segment of
`update_weights_from_tensors` never outlives the call (docs/weight-updates.md), and a control call made while the
supervisor restarts the core waits for it as a request does (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import anyio
import pytest
import torch

from asyncllm.engine import weight_tensors
from asyncllm.engine.engine_control import EngineControl
from asyncllm.engine.engine_weights import EngineWeights
from asyncllm.engine.replica import ReplicaSet
from asyncllm.engine.supervisor import CoreSupervisor
from asyncllm.errors import EngineDeadError


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"asyncllm-{os.getpid()}-w-")}


class _Processor:
    dead = None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


class _Engine(EngineControl):
    """`EngineControl` over fake replicas (started already)."""

    def __init__(self, replicas: list[SimpleNamespace]) -> None:
        self._replicas = ReplicaSet(replicas)  # type: ignore[arg-type]
        self._weights = EngineWeights()

    async def start(self) -> None:
        pass


def _replica(processor: _Processor | None, restart=None) -> SimpleNamespace:
    """A replica as `ReplicaSet` reads it (``alive`` kept in step with ``processor`` by hand)."""
    return SimpleNamespace(processor=processor, alive=processor is not None, check_dead=lambda: None,
                           supervisor=CoreSupervisor(1, restart or (lambda: asyncio.sleep(0))))


async def test_a_control_call_during_a_core_restart_waits_for_the_new_core() -> None:
    new = _Processor()
    replica = _replica(None)

    async def restart() -> None:
        await asyncio.sleep(0.05)
        replica.processor, replica.alive = new, True

    replica.supervisor._restart = restart
    replica.supervisor.on_core_dead(RuntimeError("killed"))
    assert replica.supervisor.restarting
    assert await _Engine([replica]).reset_prefix_cache() is True
    assert new.calls == ["reset_prefix_cache"]


async def test_a_push_to_a_dead_engine_copies_nothing_into_shared_memory(monkeypatch) -> None:
    before, packed = _segments(), []
    monkeypatch.setattr(weight_tensors, "pack_tensors", packed.append)
    with pytest.raises(EngineDeadError, match="the engine was closed"):
        await _Engine([_replica(None)]).update_weights_from_tensors({"w": torch.ones(4)})
    assert packed == [] and _segments() == before


async def test_an_update_no_replica_takes_unlinks_the_segment_at_once() -> None:
    closed: list[bool] = []
    with pytest.raises(EngineDeadError):
        await EngineWeights().update(ReplicaSet([_replica(None)]), None,  # type: ignore[list-item, arg-type]
                                     when_answered=lambda: closed.append(True))
    assert closed == [True]


def _slow_pack(monkeypatch) -> tuple[threading.Event, list]:
    """`pack_tensors` made to wait for the event; the packed segments it made go to the list."""
    release, made, pack_tensors = threading.Event(), [], weight_tensors.pack_tensors

    def slow_pack(named_tensors):
        release.wait(5)
        made.append(pack_tensors(named_tensors))
        return made[-1]

    monkeypatch.setattr(weight_tensors, "pack_tensors", slow_pack)
    return release, made


async def _wait_unlinked(made: list) -> None:
    deadline = time.monotonic() + 5
    while not made or os.path.exists(f"/dev/shm/{made[0].segment.name}"):
        assert time.monotonic() < deadline, "the caller's segment stayed in /dev/shm after it left"
        await asyncio.sleep(0.01)


async def test_a_caller_cancelled_while_the_tensors_are_copied_leaves_no_segment(monkeypatch) -> None:
    release, made = _slow_pack(monkeypatch)
    task = asyncio.create_task(weight_tensors.pack_off_loop({"w": torch.ones(4)}))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()  # the copy ends after its caller left: the thread unlinks the segment
    await _wait_unlinked(made)


async def test_an_anyio_deadline_during_the_copy_returns_at_once_and_leaves_no_segment(monkeypatch) -> None:
    release, made = _slow_pack(monkeypatch)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await weight_tensors.pack_off_loop({"w": torch.ones(4)})
    assert time.monotonic() - started < 2, "the caller waited out the copy past its deadline"
    release.set()
    await _wait_unlinked(made)
