"""A new adapter id's check (a hub lookup or download, the folder read, the NaN scan) runs off the caller's thread,
once for every request waiting on it (`AdapterChecker.checking`); its failure is each waiter's typed error and is not
kept; a waiter that gives up cancels nothing; the processor thread parks such requests (asyncllm/engine/
processor_lora.py), and a parked request's id is in use, never forgotten as idle. End to end, with the hub's download
blocked: tests/engine/test_lora_hub_engine.py."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest

from asyncllm import InvalidRequestError, LoRARequest, lora_checker
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.processor_requests import ProcessorRequests, Submit
from asyncllm.engine.stream import RequestOptions
from asyncllm.metrics.observer import RequestObserver
from asyncllm.sampling import SamplingParams
from test_core_validation import _adapter_folder
from test_lora_id_bound import _checker


class _SlowHub:
    """`lora_checker._resolve` as a hub download held until `release`, counting the downloads and their threads;
    `fail`: the hub's answer is an error that is no ConfigError."""

    def __init__(self, folder: str, fail: bool = False) -> None:
        self.folder, self.fail = folder, fail
        self.started, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def __call__(self, path: str) -> str:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.release.wait(30)
        if self.fail:
            raise RuntimeError("the hub answered garbage")
        return self.folder


def test_a_new_id_is_checked_once_off_the_calling_thread_for_every_request_naming_it(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = _SlowHub(_adapter_folder(tmp_path / "a"))
    monkeypatch.setattr(lora_checker, "_resolve", hub)
    checker = _checker(kept=8)
    request = LoRARequest("a", 7, "org/adapter")
    first = checker.checking(request)
    assert hub.started.wait(30) and not first.done()  # the caller was not held
    again = checker.checking(LoRARequest("a", 7, "org/adapter"))  # the same adapter, as given: the same check
    other = checker.checking(LoRARequest("b", 7, "org/other"))  # another adapter of the id: after it, refused
    assert again is first and other is not first and not other.done()
    hub.release.set()
    assert first.result(30).lora_path == hub.folder == again.result(30).lora_path
    with pytest.raises(InvalidRequestError, match="one id, one adapter"):
        other.result(30)
    assert hub.threads == ["asyncllm-lora-check"]  # one download, on its own thread
    settled = checker.checking(request)  # checked: settled at once, nothing read again
    assert settled.done() and settled.result().lora_path == hub.folder and len(hub.threads) == 1


def test_a_failed_check_is_each_waiters_typed_error_and_is_not_kept(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = _SlowHub(_adapter_folder(tmp_path / "a"), fail=True)
    monkeypatch.setattr(lora_checker, "_resolve", hub)
    checker = _checker(kept=8)
    waiters = [checker.checking(LoRARequest("a", 3, "org/adapter")) for _ in range(2)]
    hub.release.set()
    for waiter in waiters:
        with pytest.raises(InvalidRequestError, match="RuntimeError: the hub answered garbage") as raised:
            waiter.result(30)
        assert raised.value.field == "lora_request" and "org/adapter" in raised.value.message
    assert len(hub.threads) == 1 and checker.ids() == set()
    hub.fail = False  # the hub answers again: the id is checked afresh
    assert checker.checking(LoRARequest("a", 3, "org/adapter")).result(30).lora_path == hub.folder
    assert len(hub.threads) == 2 and checker.ids() == {3}


def test_remove_wins_over_the_check_in_flight_it_overtook(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`forget` (remove_lora) while an id's checks are in flight, the one reading and one queued after it: neither
    records the adapter, every waiter gets an `InvalidRequestError` saying it was removed; the id used again is
    checked afresh (it may name another folder now)."""
    hub = _SlowHub(_adapter_folder(tmp_path / "a"))
    monkeypatch.setattr(lora_checker, "_resolve", hub)
    checker = _checker(kept=8)
    first = checker.checking(LoRARequest("a", 6, "org/adapter"))
    queued = checker.checking(LoRARequest("a2", 6, "org/adapter"))  # another name: checked after the first
    assert hub.started.wait(30)
    assert checker.forget(6) is True  # it was being checked
    hub.release.set()
    for waiter in (first, queued):
        with pytest.raises(InvalidRequestError, match="lora_int_id 6 was removed \\(remove_lora\\) while") as raised:
            waiter.result(30)
        assert raised.value.field == "lora_request"
    assert checker.ids() == set() and checker.given(6) is None
    other = hub.folder = _adapter_folder(tmp_path / "b")
    assert checker.checking(LoRARequest("b", 6, "org/other")).result(30).lora_path == other
    assert checker.ids() == {6} and len(hub.threads) == 2  # the queued check, removed before its turn, read nothing


def test_a_malformed_request_is_settled_at_once() -> None:
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        _checker(kept=8).checking(LoRARequest("a", 0, "org/adapter")).result(0)


async def test_a_waiter_that_gives_up_cancels_no_check(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted request's wait (`asyncio.wrap_future` cancelled) leaves the check to the others: it runs on and
    records the adapter."""
    hub = _SlowHub(_adapter_folder(tmp_path / "a"))
    monkeypatch.setattr(lora_checker, "_resolve", hub)
    checker = _checker(kept=8)
    shared = checker.checking(LoRARequest("a", 4, "org/adapter"))
    waiter = asyncio.ensure_future(asyncio.wrap_future(shared))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not shared.cancelled()
    hub.release.set()
    assert (await asyncio.wrap_future(shared)).lora_path == hub.folder and checker.ids() == {4}


def test_a_checked_adapter_is_recorded_again_without_a_read_once_forgotten(tmp_path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A parked request's adapter forgotten as idle between its check and its turn on the processor thread is
    recorded again from the check's outcome (`check`'s ``checked``): that thread reads nothing."""
    checker = _checker(kept=8)
    request = LoRARequest("a", 5, _adapter_folder(tmp_path / "a"))
    checked = checker.checking(request).result(30)
    assert checker.forget(5)
    monkeypatch.setattr(lora_checker, "read_adapter", lambda path: pytest.fail("read on the processor thread"))
    assert checker.check(request, checked) == checked and checker.ids() == {5}


def test_a_parked_requests_id_is_never_forgotten_as_idle(tmp_path) -> None:
    a = _adapter_folder(tmp_path / "a")
    checker = _checker(kept=1)
    for lora_int_id in (1, 2, 3):
        checker.check(LoRARequest("a", lora_int_id, a))
    parked = SimpleNamespace(options=SimpleNamespace(lora_request=LoRARequest("a", 1, a)))
    host = SimpleNamespace(_lora=checker, _tracked={"r#0": SimpleNamespace(lora_int_id=2)}, _parked={"p": parked},
                           _encoder=msgspec.msgpack.Encoder())
    frames: list[bytes] = []
    ProcessorRequests._forget_idle_loras(host, SimpleNamespace(send=frames.append))  # type: ignore[arg-type]
    assert checker.ids() == {1, 2} and len(frames) == 1  # 3 alone was idle (and not the newest: kept 1 // 8 = 0)


def test_a_parked_request_aborted_or_closed_is_counted_as_any_aborted_request(tmp_path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A request parked while its adapter is checked and aborted there (`engine.abort`, its stream left), or ended
    by the engine's close, never reaches the core, yet the metrics observer counts it as a tracked request aborted
    then: `request_success_total{finished_reason="abort"}` once per sample."""
    hub = _SlowHub(_adapter_folder(tmp_path / "a"))
    monkeypatch.setattr(lora_checker, "_resolve", hub)
    observer = RequestObserver("m")
    host = ProcessorRequests()  # the processor thread's LoRA side alone: no core, no thread
    host._lora, host._parked, host._tracked, host._observer = _checker(kept=8), {}, {}, observer
    host._post = lambda job: None  # type: ignore[method-assign]  # the check's "lora_checked": not handled here

    def park(request_id: str, n: int) -> None:
        job = Submit(RequestCollector(request_id, time.time(), n=n), [1, 2], SamplingParams(n=n, max_tokens=4),
                     RequestOptions(lora_request=LoRARequest("a", 9, "org/adapter")))
        assert host._park(job)

    try:
        park("left", 2)
        host._unpark("left")  # an abort
        assert host._parked == {} and observer.stats.request_success["abort"] == 2
        host._unpark("left")  # gone already: counted once
        park("closed", 1)
        ended = host._end_parked(None)  # the engine closed
        assert [(item.index, item.finish_reason) for _, item in ended] == [(0, "abort")]
        assert observer.stats.request_success["abort"] == 3
    finally:
        hub.release.set()
