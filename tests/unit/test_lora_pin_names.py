"""`pin_lora`'s refusals name its only argument, ``lora_id``, wherever they come from: the host's check, the engine
core's binding (a folder the core cannot read, an id of another folder, an engine without LoRA), or a core that
names them as the generate path does; the generate path's and `add_lora`'s errors keep their names. And a core
restarted by its supervisor is given its host's adapter ids again (`EnginePins.pin_again` sends an `AddLoRA` for
each id not pinned, the host's record adopted from the dead processor): bound there, or, refused (its folder gone),
forgotten by the host. End to end: tests/engine/test_lora_restart_engine.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
from types import SimpleNamespace

import pytest

from asyncllm import InvalidRequestError, LoRARequest, protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.engine_control import EngineControl
from asyncllm.engine.engine_pins import EnginePins
from asyncllm.engine.processor_lora import ProcessorLoRA
from asyncllm.lora_checker import AdapterChecker
from test_core_validation import _add
from test_lora_pin import _pinning_core
from test_lora_pin_host import _CoreThread, _engine, _replicas


def test_the_core_names_every_pin_refusal_lora_id(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The core's `bind` refuses a `PinLoRA` as it refuses an `AddLoRA` or a request, but named ``lora_id`` (its
    message saying whose folder); the same refusals of `add_lora` and of a request keep ``lora_path`` and
    ``lora_request``."""
    core, workers, replies, deltas, (a, b, *_) = _pinning_core(monkeypatch, tmp_path)
    gone = str(tmp_path / "gone")
    core._handle(b"h", protocol.PinLoRA("gone", LoRARequest("gone", 9, gone)))
    assert (replies[-1].error_type, replies[-1].error_field) == ("InvalidRequestError", "lora_id")
    assert replies[-1].error.startswith("the adapter of lora_int_id 9: the engine core cannot use it: the adapter "
                                        f"at {gone}")
    core._handle(b"h", protocol.AddLoRA("gone", LoRARequest("gone", 9, gone)))
    assert (replies[-1].error_field, replies[-1].error.split(":")[0]) == ("lora_path", "the engine core cannot use it")

    core._handle(b"h", protocol.AddLoRA("a", LoRARequest("a", 3, a)))
    assert replies[-1].error_type == ""
    core._handle(b"h", protocol.PinLoRA("clash", LoRARequest("b", 3, b)))  # one id, one adapter
    assert replies[-1].error_field == "lora_id" and replies[-1].error.startswith(
        f"lora_int_id 3 already names the adapter at {a}")
    core._handle(b"h", protocol.AddLoRA("clash", LoRARequest("b", 3, b)))
    assert replies[-1].error_field == "lora_request"
    _add(core, "r", lora=LoRARequest("b", 3, b))  # the generate path
    assert deltas[-1].error.startswith(f"lora_request: lora_int_id 3 already names the adapter at {a}")

    core.config = EngineConfig.create("dummy-model", block_size=4)  # without enable_lora
    core._handle(b"h", protocol.PinLoRA("off", LoRARequest("a", 3, a)))
    assert (replies[-1].error_field, replies[-1].error) == ("lora_id", "this engine serves no LoRA adapters: start "
                                                                       "it with enable_lora=True")
    core._handle(b"h", protocol.AddLoRA("off", LoRARequest("a", 3, a)))
    assert replies[-1].error_field == "lora_request"
    assert workers.took() == [] and core.lora_ids.pinned == {}


def test_the_host_names_a_cores_pin_refusal_lora_id(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """`AsyncEngine.pin_lora` over two replicas: replica 1's core cannot read the folder (gone since the host's
    check): the call fails naming ``lora_id``, undone on replica 0; so does a core that names its refusal as the
    generate path does (``lora_path``), and the host's own check's refusal (``lora_request`` there)."""
    replicas, workers = _replicas(monkeypatch, tmp_path)
    engine = _engine(replicas)
    own: concurrent.futures.Future = concurrent.futures.Future()
    own.set_result(replicas[1].given)  # replica 1's host checked its own folder, which is gone since
    replicas[1].checking_lora = lambda lora: own
    shutil.rmtree(replicas[1].given.lora_path)
    with pytest.raises(InvalidRequestError, match="^lora_id: the adapter of lora_int_id 3: the engine core cannot "
                                                  "use it") as raised:
        asyncio.run(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
    assert raised.value.field == "lora_id"
    assert workers[0].took() == [(1, False), (1, True)] and workers[1].took() == []  # undone on replica 0

    def generate_path_names(message: protocol.PinLoRA) -> concurrent.futures.Future:
        refused: concurrent.futures.Future = concurrent.futures.Future()
        refused.set_exception(InvalidRequestError("lora_path", "the engine core cannot use it: gone"))
        return refused

    replicas[1].lora_call = generate_path_names
    with pytest.raises(InvalidRequestError, match="^lora_id: the adapter of lora_int_id 3: the engine core cannot use "
                                                  "it: gone$"):
        asyncio.run(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]

    def check_refuses(lora: LoRARequest) -> concurrent.futures.Future:
        refused: concurrent.futures.Future = concurrent.futures.Future()
        refused.set_exception(InvalidRequestError("lora_request", "the adapter at x: it has no adapter_config.json"))
        return refused

    replicas[1].checking_lora = check_refuses  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="^lora_id: the adapter at x: it has no adapter_config.json$"):
        asyncio.run(EngineControl.pin_lora(engine, 3))  # type: ignore[arg-type]
    assert engine._pins.pinned == {} and all(replica.core.lora_ids.pinned == {} for replica in replicas)


class _Host(ProcessorLoRA):
    """A processor's LoRA half (the real one: `adopt_loras`, `add_loras_again`, `lora_given`, ...) whose calls a
    real core answers (`_CoreThread`)."""

    def __init__(self, checker: AdapterChecker, core: _CoreThread) -> None:
        self._lora, self._core = checker, core

    def lora_call(self, message):  # type: ignore[override]
        return self._core.lora_call(message)


def _checker() -> AdapterChecker:
    config = SimpleNamespace(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                             intermediate_size=16, architectures=["LlamaForCausalLM"], model_type="llama")
    return AdapterChecker(config, 8)


def test_a_restarted_core_is_given_the_hosts_adapter_ids_again(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The host knew ids 3 (pinned), 4, 5 and 6; its core died; 5's folder went away since. The new processor adopts
    the host's record; `pin_again` adds 4, 5 and 6 again (least recently used first, nothing read on the host) and
    pins 3: the new core binds 4 and 6 and pins 3; 5, refused, is forgotten by the host (logged), the others listed."""
    (tmp_path / "old").mkdir()
    old_core, _, _, _, folders = _pinning_core(monkeypatch, tmp_path / "old")
    old = _Host(_checker(), _CoreThread(old_core, [], LoRARequest("a", 3, folders[0])))
    adapters = [LoRARequest(name, 3 + i, folder) for i, (name, folder) in enumerate(zip("abcd", folders))]
    for lora in adapters:
        old.remember_lora(lora, lora)  # checked before the crash
    old.pin_lora_id(3)
    pins = EnginePins()
    pins.pinned[3] = (adapters[0], adapters[0])

    (tmp_path / "new").mkdir()
    core, workers, replies, _, _ = _pinning_core(monkeypatch, tmp_path / "new")
    new = _Host(_checker(), _CoreThread(core, replies, adapters[0]))
    assert new.lora_ids() == set()
    shutil.rmtree(adapters[2].lora_path)
    live = SimpleNamespace(any_alive=True, live_processors=lambda: [new])
    with caplog.at_level(logging.ERROR, "asyncllm.engine"):
        asyncio.run(pins.settle(pins.pin_again(new, old), live))  # type: ignore[arg-type]
    assert [type(reply).__name__ for reply in replies] == ["LoRAAdded"] * 3 + ["LoRAPinned"]
    assert core.lora_ids.core_ids(b"h") == {4: 1, 6: 2, 3: 3}  # 5 refused: not bound
    assert list(core.lora_ids.pinned) == [3] and workers.took() == [(3, False)]
    assert new.lora_ids() == {3, 4, 6} and set(pins.pinned) == {3}
    assert "could not add LoRA adapter 'c' (id 5) again" in caplog.text


def test_an_id_removed_while_another_replica_restarts_is_not_added_again_there(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path) -> None:
    """Two replicas know id 4; replica 1's core died and restarts (its dead processor still holds the host's
    record, which the new one adopts) while replica 0 serves: `remove_lora(4)` acts on replica 0 at once. The
    restarted replica must not add 4 again (bound to its old folder: the id used again must be checked afresh)."""
    (tmp_path / "r0").mkdir()
    core0, _, replies0, _, folders = _pinning_core(monkeypatch, tmp_path / "r0")
    adapter = LoRARequest("b", 4, folders[1])
    live = _Host(_checker(), _CoreThread(core0, replies0, adapter))
    dead = _Host(_checker(), _CoreThread(core0, [], adapter))  # (no call reaches it)
    for host in (live, dead):
        host.remember_lora(adapter, adapter)

    async def serving_processors() -> list:
        return [live]  # replica 1 restarts: not serving

    engine = SimpleNamespace(start=lambda: asyncio.sleep(0), _pins=EnginePins(),
                             _replicas=SimpleNamespace(serving_processors=serving_processors, replicas=[
                                 SimpleNamespace(processor=live), SimpleNamespace(processor=dead)]))
    assert asyncio.run(EngineControl.remove_lora(engine, 4)) is True  # type: ignore[arg-type]
    (tmp_path / "r1").mkdir()
    core1, _, replies, _, _ = _pinning_core(monkeypatch, tmp_path / "r1")
    new = _Host(_checker(), _CoreThread(core1, replies, adapter))
    pins = engine._pins
    asyncio.run(pins.settle(pins.pin_again(new, dead), SimpleNamespace(any_alive=True,  # type: ignore[arg-type]
                                                                        live_processors=lambda: [new, live])))
    assert new.lora_ids() == set() and replies == []
