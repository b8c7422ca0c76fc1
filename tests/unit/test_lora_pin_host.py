"""The host's half of `pin_lora` across replicas (asyncllm/engine/engine_pins.py), on real cores with fake workers:
a cancelled pin is undone on every replica before the cancel is raised (a second cancel included), and never
undoes a pin made before it; a restarted core gets the pins again, and one it refuses is undone everywhere.
End to end (a core killed and restarted): tests/engine/test_lora_restart_engine.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from types import SimpleNamespace

import pytest

from asyncllm import LoRARequest, protocol
from asyncllm.engine.engine_control import EngineControl
from asyncllm.engine.engine_pins import EnginePins
from asyncllm.engine.lora_ids import PendingLoRACalls
from test_lora_pin import _pinning_core


class _CoreThread:
    """A replica's processor whose core handles each LoRA call on a thread of its own, in order, as the processor
    thread and the core do; the host's marks (`pin_lora_id`) and adapters remembered again (`remember_lora`)."""

    def __init__(self, core, replies: list, given: LoRARequest) -> None:
        self.core, self.replies, self.given, self.calls = core, replies, given, PendingLoRACalls()
        self.pinned: set[int] = set()
        self.remembered: list[LoRARequest] = []
        self.hold, self.release, self.started = False, threading.Event(), threading.Event()
        """`hold`: a pin (not an unpin) waits for `release` before the core handles it (its workers slow)."""
        self._inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            message = self._inbox.get()
            if self.hold and not message.unpin:
                self.started.set()
                assert self.release.wait(30)
            self.core._handle(b"h", message)
            self.calls.resolve(self.replies[-1])

    def lora_given(self, lora_id: int) -> LoRARequest:
        return self.given

    def checking_lora(self, lora: LoRARequest) -> concurrent.futures.Future:
        checked: concurrent.futures.Future = concurrent.futures.Future()
        checked.set_result(lora)
        return checked

    def pin_lora_id(self, lora_id: int, pinned: bool = True) -> None:
        (self.pinned.add if pinned else self.pinned.discard)(lora_id)

    def remember_lora(self, given: LoRARequest, checked: LoRARequest) -> None:
        self.remembered.append(checked)

    def lora_call(self, message: protocol.PinLoRA) -> concurrent.futures.Future:
        message.call_id, future = self.calls.new()
        self._inbox.put(message)
        return future


def _replicas(monkeypatch: pytest.MonkeyPatch, tmp_path, count: int = 2):
    """`count` replicas of real cores (two slots each), adapter "a" (host id 3) known, and their workers."""
    replicas, workers = [], []
    for index in range(count):
        (tmp_path / f"r{index}").mkdir(parents=True)
        core, took, replies, _, (a, *_) = _pinning_core(monkeypatch, tmp_path / f"r{index}")
        replicas.append(_CoreThread(core, replies, LoRARequest("a", 3, a)))
        workers.append(took)
    return replicas, workers


def _engine(replicas: list) -> SimpleNamespace:
    async def serving_processors() -> list:
        return replicas

    return SimpleNamespace(start=lambda: asyncio.sleep(0), _pins=EnginePins(),
                           _replicas=SimpleNamespace(serving_processors=serving_processors))


async def _cancel_while_replica_1_pins(engine: SimpleNamespace, held: _CoreThread, twice: bool = False,
                                       undoes: bool = True) -> None:
    """A `pin_lora(3)` cancelled while replica 1's core is busy before it; one that `undoes` its pin has not ended
    before that core answered."""
    held.hold = True
    task = asyncio.create_task(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
    assert await asyncio.to_thread(held.started.wait, 30)
    task.cancel()
    await asyncio.sleep(0.2)
    if twice:
        task.cancel()  # cancelled again while it undoes the pin
        await asyncio.sleep(0.1)
    assert task.done() != undoes  # the undo waits for every replica's answer
    held.release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)


@pytest.mark.parametrize("twice", [False, True])
def test_a_cancelled_pin_is_undone_on_every_replica_before_the_cancel_is_raised(
        monkeypatch: pytest.MonkeyPatch, tmp_path, twice: bool) -> None:
    replicas, workers = _replicas(monkeypatch, tmp_path)
    engine = _engine(replicas)
    asyncio.run(_cancel_while_replica_1_pins(engine, replicas[1], twice))
    for replica, took in zip(replicas, workers):  # when the cancel was raised, every core had unpinned it
        assert (replica.core.lora_ids.pinned, replica.pinned) == ({}, set())
        assert took.took() == [(1, False), (1, True)]
        assert replica.core.lora_ids.core_ids(b"h") == {3: 1}  # still bound
    assert engine._pins.pinned == {}


def test_a_cancelled_pin_of_a_pinned_id_leaves_it_pinned(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Pinning a pinned id again changes nothing, cancelled or not: the first pin stays on every replica."""
    replicas, workers = _replicas(monkeypatch, tmp_path)
    engine = _engine(replicas)

    async def pin_then_cancel_again() -> None:
        assert await EngineControl.pin_lora(engine, 3) is True  # type: ignore[arg-type]
        await _cancel_while_replica_1_pins(engine, replicas[1], undoes=False)

    asyncio.run(pin_then_cancel_again())
    for replica, took in zip(replicas, workers):
        assert list(replica.core.lora_ids.pinned) == [1] and replica.pinned == {3}
        assert took.took() == [(1, False)]  # pinned once, never unpinned
    assert list(engine._pins.pinned) == [3]


def test_a_restarted_core_pins_again_and_a_pin_it_refuses_is_undone_everywhere(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    replicas, workers = _replicas(monkeypatch, tmp_path / "old")
    engine = _engine(replicas)
    asyncio.run(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
    for took in workers:
        took.took()
    restarted, new_workers = _replicas(monkeypatch, tmp_path / "new", count=1)  # replica 0's new core: none bound
    live = SimpleNamespace(any_alive=True, live_processors=lambda: [restarted[0], replicas[1]])

    async def restart() -> None:
        await engine._pins.settle(engine._pins.pin_again(restarted[0]), live)

    asyncio.run(restart())
    new = restarted[0]
    assert new.remembered == [engine._pins.pinned[3][1]] and new.pinned == {3}  # known and pinned on its host
    assert list(new.core.lora_ids.pinned) == [1] and new_workers[0].took() == [(1, False)]
    new.core._handle(b"h", protocol.RemoveLoRA("rm", 3))  # a core restarted again: a folder unreadable now
    new_workers[0].unreadable.add(engine._pins.pinned[3][1].lora_path)
    asyncio.run(restart())  # refused: logged, and unpinned on every replica
    assert engine._pins.pinned == {} and new.pinned == set() and replicas[1].pinned == set()
    assert new.core.lora_ids.pinned == {} and replicas[1].core.lora_ids.pinned == {}
    assert workers[1].took() == [(1, True)]


def test_a_core_restarted_while_a_pin_is_in_progress_gets_that_pin(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Data parallelism, replica 1 down: `pin_lora` pins on replica 0 alone; replica 1's restarted core pins what is
    recorded as pinned before any request reaches it, so a pin still in progress then is sent to it too (else it
    alone never holds it), and undone there with the call's undo; refused there (its folder unreadable now), the call
    fails with that refusal, undone on every replica, as a pin any replica refuses."""
    for outcome in ("pinned", "cancelled", "refused"):
        replicas, workers = _replicas(monkeypatch, tmp_path / outcome)
        engine = _engine(replicas[:1])  # replica 1 down: the live replicas are replica 0's
        restarted = replicas[1]
        live = SimpleNamespace(any_alive=True, live_processors=lambda: replicas)
        if outcome == "refused":
            workers[1].unreadable.add(replicas[0].given.lora_path)  # what pin_again sends: replica 0's checked

        async def pin_across_the_restart() -> None:
            replicas[0].hold = True
            task = asyncio.create_task(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
            assert await asyncio.to_thread(replicas[0].started.wait, 30)
            await engine._pins.settle(engine._pins.pin_again(restarted), live)  # replica 1 back meanwhile
            if outcome == "cancelled":
                task.cancel()
                await asyncio.sleep(0.1)
            replicas[0].release.set()
            if outcome == "pinned":
                assert await asyncio.wait_for(task, 30) is True
            elif outcome == "refused":
                with pytest.raises(Exception) as raised:
                    await asyncio.wait_for(task, 30)
                assert not isinstance(raised.value, asyncio.CancelledError)
            else:
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 30)

        asyncio.run(pin_across_the_restart())
        expected = {3} if outcome == "pinned" else set()
        assert set(engine._pins.pinned) == expected and restarted.pinned == expected, outcome
        assert bool(restarted.core.lora_ids.pinned) == (outcome == "pinned"), outcome
        assert replicas[0].pinned == expected and bool(replicas[0].core.lora_ids.pinned) == (outcome == "pinned")


def test_a_pin_whose_id_was_removed_during_its_check_names_lora_id(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """`pin_lora`'s only argument is the id: an id removed while its adapter was checked (the checker's error, or
    the id forgotten on a replica once checked) is refused naming ``lora_id``, and nothing is pinned."""
    from asyncllm.errors import InvalidRequestError

    replicas, workers = _replicas(monkeypatch, tmp_path)
    engine = _engine(replicas)

    def removed_during_check(lora: LoRARequest) -> concurrent.futures.Future:
        failed: concurrent.futures.Future = concurrent.futures.Future()
        failed.set_exception(InvalidRequestError("lora_request", "lora_int_id 3 was removed (remove_lora) while its "
                                                                 "adapter was checked"))
        return failed

    replicas[1].checking_lora = removed_during_check
    with pytest.raises(InvalidRequestError, match="was removed") as raised:
        asyncio.run(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
    assert raised.value.field == "lora_id"
    del replicas[1].checking_lora
    replicas[1].lora_given = lambda lora_id: None  # forgotten there once checked
    with pytest.raises(InvalidRequestError, match="while pin_lora checked") as raised:
        asyncio.run(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
    assert raised.value.field == "lora_id"
    for replica, took in zip(replicas, workers):
        assert (replica.core.lora_ids.pinned, replica.pinned, took.took()) == ({}, set(), [])
    assert engine._pins.pinned == {}


def test_a_pin_waits_for_a_core_restarted_meanwhile_and_fails_with_its_late_refusal(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Replica 1 restarts while `pin_lora(3)` is in progress and answers the replayed pin only after replica 0
    answered the call's own: the call waits for that answer, so its refusal fails the call, undone everywhere,
    rather than a success the restart then drops."""
    replicas, workers = _replicas(monkeypatch, tmp_path)
    engine = _engine(replicas[:1])
    restarted = replicas[1]
    live = SimpleNamespace(any_alive=True, live_processors=lambda: replicas)
    workers[1].unreadable.add(replicas[0].given.lora_path)  # what pin_again sends: replica 0's checked

    async def pin_across_a_late_refusal() -> None:
        replicas[0].hold = restarted.hold = True
        task = asyncio.create_task(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
        assert await asyncio.to_thread(replicas[0].started.wait, 30)
        settling = asyncio.create_task(engine._pins.settle(engine._pins.pin_again(restarted), live))
        replicas[0].release.set()
        await asyncio.sleep(0.3)
        assert not task.done()  # replica 0 answered; the restarted core has not
        restarted.release.set()
        with pytest.raises(Exception) as raised:
            await asyncio.wait_for(task, 30)
        assert not isinstance(raised.value, asyncio.CancelledError)
        await asyncio.wait_for(settling, 30)

    asyncio.run(pin_across_a_late_refusal())
    assert engine._pins.pinned == {}
    for replica in replicas:
        assert replica.pinned == set() and replica.core.lora_ids.pinned == {}


def test_a_pinned_id_pinned_again_while_a_restarted_core_refuses_it_is_pinned_nowhere(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Pinned on replica 0 (replica 1 down), pinned again (in progress) while replica 1's restarted core refuses the
    replayed pin: `settle` unpins it everywhere and the call in progress fails with that refusal, so the record
    and the cores agree (nothing pinned) and no later restart replays it."""
    replicas, workers = _replicas(monkeypatch, tmp_path)
    engine = _engine(replicas[:1])
    live = SimpleNamespace(any_alive=True, live_processors=lambda: replicas)
    workers[1].unreadable.add(replicas[0].given.lora_path)

    async def pin_again_across_a_refusal() -> None:
        assert await EngineControl.pin_lora(engine, 3) is True  # type: ignore[arg-type]
        replicas[0].hold = True
        task = asyncio.create_task(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
        assert await asyncio.to_thread(replicas[0].started.wait, 30)
        settling = asyncio.create_task(engine._pins.settle(engine._pins.pin_again(replicas[1]), live))
        await asyncio.sleep(0.3)  # refused there; settle's unpin waits behind replica 0's held pin
        replicas[0].release.set()
        with pytest.raises(Exception) as raised:
            await asyncio.wait_for(task, 30)
        assert not isinstance(raised.value, asyncio.CancelledError)
        await asyncio.wait_for(settling, 30)

    asyncio.run(pin_again_across_a_refusal())
    assert engine._pins.pinned == {}
    for replica in replicas:
        assert replica.pinned == set() and replica.core.lora_ids.pinned == {}
