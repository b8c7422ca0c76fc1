"""Adapter ids are bound for a bounded time: past `kept_lora_ids` ids, the least recently used ones no request runs
with are forgotten by the host's `AdapterChecker` and the core's `HostLoRAIds` (the host tells the core with a
`RemoveLoRA`), so a program naming a new id per request leaves no entry behind; an id in flight is never forgotten
("one id, one adapter" holds while it runs), and a forgotten id is bound afresh, maybe to another folder."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from asyncllm import InvalidRequestError, LoRARequest, protocol
from asyncllm.engine.lora_ids import HostLoRAIds
from asyncllm.engine.processor_requests import ProcessorRequests
from asyncllm.engine.request_keys import request_key
from asyncllm.lora import KEPT_LORA_IDS, IdleIds, kept_lora_ids
from asyncllm.lora_checker import AdapterChecker
from test_core_validation import _add, _adapter_folder, _core


def _checker(kept: int) -> AdapterChecker:
    """A checker of a one-layer model whose q_proj is 8 x 8 (`_adapter_folder`'s adapter fits it)."""
    config = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=16,
                             num_hidden_layers=1, head_dim=None)
    return AdapterChecker(config, 8, kept_ids=kept)


def test_the_bound_is_the_cpu_cache_or_more() -> None:
    assert kept_lora_ids(1) == KEPT_LORA_IDS and kept_lora_ids(KEPT_LORA_IDS + 5) == KEPT_LORA_IDS + 5


def test_the_host_forgets_idle_ids_past_the_bound_never_one_in_flight(tmp_path) -> None:
    a, b = _adapter_folder(tmp_path / "a"), _adapter_folder(tmp_path / "b")
    checker = _checker(kept=2)
    for lora_int_id in (1, 2, 3, 1):  # 1 used again: the most recently used
        checker.check(LoRARequest("a", lora_int_id, a))
    assert checker.forget_idle(lambda: {2}) == [3]  # 2 runs: kept; 3 is the least recently used idle one
    assert list(checker._checked) == [2, 1]
    assert checker.check(LoRARequest("b", 3, b)).lora_path == b  # forgotten: bound afresh, to another folder
    with pytest.raises(InvalidRequestError, match="one id, one adapter"):
        checker.check(LoRARequest("b", 2, b))  # kept
    assert checker.forget_idle(lambda: {2}) == [1] and list(checker._checked) == [3, 2]
    assert checker.forget_idle(frozenset) == []  # within the bound


def test_a_new_id_per_request_leaves_the_bound_at_most(tmp_path) -> None:
    """The memory hunt's program: 300 requests, each naming a new id for one folder (each finished)."""
    a = _adapter_folder(tmp_path / "a")
    checker = _checker(kept=KEPT_LORA_IDS)
    for lora_int_id in range(1000, 1300):
        checker.check(LoRARequest(f"user-{lora_int_id}", lora_int_id, a))
        checker.forget_idle(frozenset)
    assert KEPT_LORA_IDS * 7 // 8 <= len(checker._checked) <= KEPT_LORA_IDS and 1299 in checker._checked


def test_the_core_forgets_idle_ids_past_the_bound_never_one_in_flight(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path) -> None:
    core, sent = _core(monkeypatch, [0.0], enable_lora=True)
    core.lora_ids = HostLoRAIds(2, core.running_lora_ids)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for lora_int_id in (1, 2, 3):
        _add(core, f"r{lora_int_id}", lora=LoRARequest("a", lora_int_id, a))
    assert sent == [] and core.lora_ids.core_ids(b"h") == {1: 1, 2: 2, 3: 3}  # all three queued: none forgotten
    core._handle(b"h", protocol.AbortRequests(["r2"]))
    _add(core, "r4", lora=LoRARequest("a", 4, a))
    assert core.lora_ids.core_ids(b"h") == {1: 1, 3: 3, 4: 4}  # 2 was the one idle
    _add(core, "r5", lora=LoRARequest("b", 2, b))  # forgotten: bound afresh to another folder, a new core id
    assert sent == [] and core.scheduler.requests[request_key(b"h", "r5")].lora_int_id == 5
    _add(core, "r6", lora=LoRARequest("b", 1, b))  # 1 is queued: still a's
    assert [(d.request_id, d.error_type) for d in sent] == [("r6", "InvalidRequestError")]
    assert "one id, one adapter" in sent[0].error


def test_the_core_forgets_the_least_recently_used_first(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    core, sent = _core(monkeypatch, [0.0], enable_lora=True)
    core.lora_ids = HostLoRAIds(2, core.running_lora_ids)
    for req_id, lora_int_id in (("r1", 1), ("r2", 2), ("r3", 1), ("r4", 3)):  # each ended before the next
        _add(core, req_id, lora=LoRARequest("a", lora_int_id, str(tmp_path)))
        core._handle(b"h", protocol.AbortRequests([req_id]))
    assert sent == [] and core.lora_ids.core_ids(b"h") == {1: 1, 3: 3}  # 1 was used after 2


def test_the_host_tells_the_core_what_it_forgot(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The host's forgotten ids reach the core as `RemoveLoRA`: an id the host checks afresh for another folder is
    not refused there for its old one (the core alone would keep it: its bound is its own)."""
    core, _ = _core(monkeypatch, [0.0], enable_lora=True)
    sent: list = []  # request deltas and call answers
    core.io = SimpleNamespace(send=lambda client, message: sent.extend(getattr(message, "outputs", [message])))
    a, b = _adapter_folder(tmp_path / "a"), _adapter_folder(tmp_path / "b")
    checker = _checker(kept=1)
    for lora_int_id in (1, 2):
        core._handle(b"h", protocol.AddLoRA(str(lora_int_id), checker.check(LoRARequest("a", lora_int_id, a))))
    frames: list[bytes] = []
    host = SimpleNamespace(_lora=checker, _tracked={"r#1": SimpleNamespace(lora_int_id=2)}, _parked={},
                           _encoder=msgspec.msgpack.Encoder())
    ProcessorRequests._forget_idle_loras(host, SimpleNamespace(send=frames.append))  # type: ignore[arg-type]
    decoder = msgspec.msgpack.Decoder(protocol.HostMessage)
    for frame in frames:
        core._handle(b"h", decoder.decode(frame))
    assert list(checker._checked) == [2] and core.lora_ids.core_ids(b"h") == {2: 2}
    _add(core, "r", lora=checker.check(LoRARequest("b", 1, b)))
    assert [m.error for m in sent if m.error] == []
    assert core.scheduler.requests[request_key(b"h", "r")].lora.lora_path == b


def _spied(ids: set[int]):
    """`ids` as an `in_use` callable that counts its calls (each a walk over the requests in flight)."""
    walks = []
    return walks, lambda: walks.append(1) or ids


def test_the_core_walks_its_requests_once_per_eighth_of_the_bound_past_it() -> None:
    """More ids in flight than the bound: a walk cannot get below it, so the next comes only after an eighth of the
    bound more ids, not per request (70 busy adapters, 1000 requests: one walk, not 1000)."""
    busy: set[int] = set()
    walks, in_use = _spied(busy)
    ids = HostLoRAIds(KEPT_LORA_IDS, in_use)
    for n in range(1070):
        host_id = n % 70 + 1
        core = ids.core_lora(b"h", LoRARequest("a", host_id, "/tmp"))
        ids.record(b"h", host_id, core)
        busy.add(core.lora_int_id)
    assert len(walks) == 1 and len(ids.core_ids(b"h")) == 70
    busy.clear()  # all ended: the next walk, at an eighth of the bound more ids than the futile one's (65: 73)
    for host_id in range(71, KEPT_LORA_IDS + 1 + KEPT_LORA_IDS // 8 + 1):
        ids.record(b"h", host_id, ids.core_lora(b"h", LoRARequest("a", host_id, "/tmp")))
    assert len(walks) == 2 and len(ids.core_ids(b"h")) == KEPT_LORA_IDS * 7 // 8  # an eighth below the bound


def test_the_host_walks_its_requests_once_per_eighth_of_the_bound_past_it(tmp_path) -> None:
    a = _adapter_folder(tmp_path / "a")
    checker = _checker(kept=16)
    walks, in_use = _spied(set(range(1, 21)))
    for n in range(200):
        checker.check(LoRARequest("a", n % 20 + 1, a))
        assert checker.forget_idle(in_use) == []
    assert len(walks) == 2 and len(checker._checked) == 20  # at 17 and 19 ids (16 // 8 apart), none per request


def test_the_newest_ids_are_never_forgotten(tmp_path) -> None:
    """`add_lora` checks an id, then posts its `AddLoRA`: the processor thread forgetting it in between (every other
    id busy) would send the core its `RemoveLoRA` first, and the core would bind an id the host forgot."""
    a = _adapter_folder(tmp_path / "a")
    checker = _checker(kept=8)
    for lora_int_id in range(1, 10):  # 9, add_lora's, no request runs with yet
        checker.check(LoRARequest("a", lora_int_id, a))
    assert checker.forget_idle(lambda: set(range(1, 9))) == [] and 9 in checker._checked
    ids = HostLoRAIds(8, lambda: set(range(1, 9)))  # the core: its AddLoRA past the bound, every other id busy
    for lora_int_id in range(1, 10):
        ids.record(b"h", lora_int_id, ids.core_lora(b"h", LoRARequest("a", lora_int_id, "/tmp")))
    assert 9 in ids.core_ids(b"h")


class _NoLock:
    def __enter__(self) -> None:
        raise AssertionError("the checker's lock taken while nothing was due")

    def __exit__(self, *exc: object) -> None:
        pass


def test_the_host_takes_no_lock_per_request_while_nothing_is_due(tmp_path) -> None:
    """Each request (most name no adapter) calls `forget_idle`: within the bound, or short of the next walk, it
    answers without the lock; `IdleIds.settled` holds exactly where `to_forget` would do nothing."""
    a = _adapter_folder(tmp_path / "a")
    checker = _checker(kept=16)
    for lora_int_id in range(1, 17):
        checker.check(LoRARequest("a", lora_int_id, a))
    lock, checker._lock = checker._lock, _NoLock()
    assert checker.forget_idle(lambda: set()) == []
    checker._lock = lock
    checker.check(LoRARequest("a", 17, a))
    assert checker.forget_idle(lambda: set()) == [1, 2, 3]  # past the bound: due, walked under the lock
    idle = IdleIds(16)
    for size in [20, 5, 4, 17, 18, 16, 30, 19, 40, 3, 17]:  # futile walks (all busy) raise the next walk's size
        settled = idle.settled(size)
        walk_at = idle._walk_at
        walks, busy = _spied(set(range(size)))
        assert idle.to_forget(range(size), busy) == [] and settled == (walks == [] and idle._walk_at == walk_at)
