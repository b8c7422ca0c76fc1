"""`pin_lora` without a model run: the core binds and pins (every worker rank asked, pinned only if all did), refuses
by name (a third pin for two slots, the last slot while another adapter's request is in the core, a request of an
unpinned adapter while every slot is pinned), never forgets a pinned id as idle, unpins on the workers at
`remove_lora` and when the host leaves, pins again on restarted workers; the scheduler counts a pinned adapter
against max_loras. End to end: tests/engine/test_lora_pin_engine.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import pytest

from asyncllm import InvalidRequestError, LoRARequest, SamplingParams, protocol
from asyncllm.engine.core_lora import pin_again
from asyncllm.engine.engine_control import EngineControl
from asyncllm.engine.engine_pins import EnginePins
from asyncllm.engine.lora_ids import HostLoRAIds, PendingLoRACalls
from asyncllm.sched.request import Request
from test_core_validation import _adapter_folder, _add, _core
from test_scheduler import EOS, make_scheduler, run_step


class _Workers:
    """The executor's `pin_lora`: records each command; refuses the folders in ``unreadable``."""

    def __init__(self) -> None:
        self.commands: list[protocol.PinLoRA] = []
        self.unreadable: set[str] = set()

    def pin_lora(self, command: protocol.PinLoRA) -> list[protocol.LoRAPinned]:
        self.commands.append(command)
        if command.lora.lora_path in self.unreadable and not command.unpin:
            return [protocol.LoRAPinned(command.call_id, 0), protocol.LoRAPinned(
                command.call_id, 1, error_type="InvalidRequestError", error_field="lora_id", error="unreadable")]
        return [protocol.LoRAPinned(command.call_id, rank) for rank in (0, 1)]

    def took(self) -> list[tuple[int, bool]]:
        """(core id, unpin) of the commands since the last call."""
        took, self.commands = [(c.lora.lora_int_id, c.unpin) for c in self.commands], []
        return took


def _pinning_core(monkeypatch: pytest.MonkeyPatch, tmp_path):
    core, deltas = _core(monkeypatch, [0.0], enable_lora=True, max_loras=2)
    core.lora_ids = HostLoRAIds(kept=8, in_use=core.running_lora_ids, slots=2)
    core.scheduler.pinned_loras = core.lora_ids.pinned.keys()
    workers = _Workers()
    core.executor = SimpleNamespace(vocab_size=core.executor.vocab_size, pin_lora=workers.pin_lora)
    core.overlap = None
    replies: list = []
    core.io = SimpleNamespace(send=lambda client, message: (deltas.extend(message.outputs)
                                                            if isinstance(message, protocol.Outputs)
                                                            else replies.append(message)))
    monkeypatch.setattr(core, "send_outputs", lambda outputs: None, raising=False)
    folders = [_adapter_folder(tmp_path / name) for name in "abcd"]
    return core, workers, replies, deltas, folders


def test_the_core_pins_on_every_rank_and_refuses_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    core, workers, replies, deltas, (a, b, c, d) = _pinning_core(monkeypatch, tmp_path)
    core._handle(b"h", protocol.PinLoRA("a", LoRARequest("a", 3, a)))
    assert (replies[-1].call_id, replies[-1].error_type) == ("a", "") and workers.took() == [(1, False)]
    assert list(core.lora_ids.pinned) == [1] and core.lora_ids.core_ids(b"h") == {3: 1}
    core._handle(b"h", protocol.PinLoRA("a again", LoRARequest("a", 3, a)))  # pinned already: the workers are not asked
    assert replies[-1].error_type == "" and workers.took() == []

    workers.unreadable.add(b)  # one rank cannot read it: not pinned, and the rank that did unpins it
    core._handle(b"h", protocol.PinLoRA("b", LoRARequest("b", 4, b)))
    assert (replies[-1].error_field, replies[-1].error) == ("lora_id", "unreadable")
    assert workers.took() == [(2, False), (2, True)] and list(core.lora_ids.pinned) == [1]
    core._handle(b"h", protocol.PinLoRA("gone", LoRARequest("gone", 9, str(tmp_path / "gone"))))
    assert replies[-1].error_field == "lora_id" and workers.took() == []  # (an AddLoRA: lora_path)
    assert replies[-1].error.startswith("the adapter of lora_int_id 9: the engine core cannot use it: the adapter at ")

    _add(core, "r", lora=LoRARequest("c", 5, c))  # adapter c in the core: the last slot stays unpinned
    workers.unreadable.clear()
    core._handle(b"h", protocol.PinLoRA("b", LoRARequest("b", 4, b)))
    assert replies[-1].error_field == "lora_id" and "pin the last of the max_loras=2" in replies[-1].error
    core.abort(b"h", list(core.scheduler.requests))
    core._handle(b"h", protocol.PinLoRA("b", LoRARequest("b", 4, b)))
    assert replies[-1].error_type == "" and list(core.lora_ids.pinned) == [1, 2]
    core._handle(b"h", protocol.PinLoRA("c", LoRARequest("c", 5, c)))
    assert "cannot pin more adapters than max_loras=2" in replies[-1].error
    _add(core, "s", lora=LoRARequest("d", 6, d))
    assert "every one of the max_loras=2 adapter slots holds a pinned adapter" in deltas[-1].error
    _add(core, "t", lora=LoRARequest("a", 3, a))  # a pinned adapter's requests run
    assert [r.lora_int_id for r in core.scheduler.requests.values()] == [1]
    workers.took()

    for i in range(20):  # many idle ids: the pinned ones are never forgotten
        core.lora_ids.record(b"h", 100 + i, LoRARequest("x", 50 + i, a))
    assert {3: 1, 4: 2}.items() <= core.lora_ids.core_ids(b"h").items()
    pin_again(core)  # restarted workers
    assert workers.took() == [(1, False), (2, False)]
    core._handle(b"h", protocol.RemoveLoRA("rm", 4))
    assert (replies[-1].removed, workers.took(), list(core.lora_ids.pinned)) == (True, [(2, True)], [1])
    core._remove_client(b"h")  # its host left: its pins end
    assert (workers.took(), core.lora_ids.pinned) == ([(1, True)], {})


class _Replica:
    """A data-parallel replica's processor whose LoRA calls its core answers at once."""

    def __init__(self, core, replies: list, given: LoRARequest) -> None:
        self.core, self.replies, self.given, self.calls = core, replies, given, PendingLoRACalls()

    def lora_given(self, lora_id: int) -> LoRARequest:
        return self.given

    def checking_lora(self, lora: LoRARequest) -> concurrent.futures.Future:
        checked: concurrent.futures.Future = concurrent.futures.Future()
        checked.set_result(lora)
        return checked

    def pin_lora_id(self, lora_id: int, pinned: bool = True) -> None:
        pass

    def lora_call(self, message: protocol.PinLoRA) -> concurrent.futures.Future:
        message.call_id, future = self.calls.new()
        self.core._handle(b"h", message)
        self.calls.resolve(self.replies[-1])
        return future


def test_a_pin_refused_by_one_replica_is_pinned_on_none(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Data parallelism: replica 1 refuses the last slot (another adapter's request in its core), so `pin_lora`
    raises; replica 0, which pinned the adapter, unpins it (on its workers too), the id still bound there."""
    core0, workers0, replies0, _, (a, _, c, d) = _pinning_core(monkeypatch, tmp_path)
    (tmp_path / "r1").mkdir()
    core1, _, replies1, _, _ = _pinning_core(monkeypatch, tmp_path / "r1")
    _add(core1, "r", lora=LoRARequest("c", 5, c))
    core1._handle(b"h", protocol.PinLoRA("d", LoRARequest("d", 6, d)))  # one of its two slots pinned
    replicas = [_Replica(core, replies, LoRARequest("a", 3, a)) for core, replies in ((core0, replies0),
                                                                                      (core1, replies1))]

    async def serving_processors() -> list[_Replica]:
        return replicas

    engine = SimpleNamespace(start=lambda: asyncio.sleep(0), _pins=EnginePins(),
                             _replicas=SimpleNamespace(serving_processors=serving_processors))
    with pytest.raises(InvalidRequestError, match="pin the last of the max_loras=2"):
        asyncio.run(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
    assert core0.lora_ids.pinned == {} and core0.lora_ids.core_ids(b"h") == {3: 1}
    assert workers0.took() == [(1, False), (1, True)] and list(core1.lora_ids.pinned) == [2]


def _request(req_id: str, lora_id: int) -> Request:
    lora = LoRARequest(f"l{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    start = 1000 * (ord(req_id[0]) - ord("a") + 1)
    return Request(req_id, list(range(start, start + 6)), SamplingParams(max_tokens=3), [EOS], 0.0, lora=lora)


def test_a_pinned_adapter_holds_a_slot_in_the_scheduler() -> None:
    """max_loras=2 with adapter 1 pinned: one more adapter runs at a time; adapter 1's and the base model's requests
    are admitted beside it."""
    sched = make_scheduler(enable_lora=True, max_loras=2)
    sched.pinned_loras = {1}
    for req_id, lora_id in [("a", 2), ("b", 3), ("c", 1), ("d", 0)]:
        sched.add_request(_request(req_id, lora_id))
    out, _ = run_step(sched)
    assert [n.req_id for n in out.new_reqs] == ["a", "c", "d"] and [r.request_id for r in sched.waiting] == ["b"]
    while sched.requests:
        run_step(sched)
        assert len({r.lora_int_id for r in sched.running} - {0, 1}) <= 1
