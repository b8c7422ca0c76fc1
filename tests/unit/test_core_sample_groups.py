"""The engine core refuses an n > 1 request's samples together (asyncllm/engine/sample_groups.py): when sample 0 is
refused, no other sample is queued or scheduled, each gets the same typed error, nothing is left behind, and the
other requests are served. Driven through `EngineCore._handle` without workers."""

from __future__ import annotations

import time

import pytest

from asyncllm import SamplingParams, StructuredOutputs, protocol
from asyncllm.engine.core import EngineCore
from asyncllm.engine.request_keys import request_key
from asyncllm.engine.sample_groups import sibling_ids
from asyncllm.engine.validation import MAX_N
from asyncllm.mm.cache import MultiModalCacheMiss
from test_core_validation import _core
from test_scheduler import run_step

SAMPLES = [f"g#1-{i}" for i in range(3)]
"""The host's core ids of an n=3 request (`sample_request_ids`)."""


def _send(core: EngineCore, req_id: str, num_samples: int = 1, structured: StructuredOutputs | None = None) -> None:
    core._handle(b"h", protocol.AddRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=2, structured=structured),
                                           [2], time.time(), num_samples=num_samples))


def _send_samples(core: EngineCore, order: list[int], structured: StructuredOutputs | None = None) -> None:
    for i in order:
        _send(core, SAMPLES[i], 0 if i else len(SAMPLES), structured)


def _busy_core(monkeypatch: pytest.MonkeyPatch):
    """A core whose one seat runs "busy" and whose queue (max 2) holds "w": an n=3 request is refused."""
    core, sent = _core(monkeypatch, [0.0], max_num_queued_requests=2, max_num_seqs=1)
    _send(core, "busy")
    run_step(core.scheduler)
    _send(core, "w")
    return core, sent


def _run_to_idle(core: EngineCore) -> set[str]:
    """Step until every request finished; the keys of those scheduled."""
    scheduled: set[str] = set()
    for _ in range(20):
        if not core.scheduler.has_unfinished_requests():
            return scheduled
        out, _ = run_step(core.scheduler)
        scheduled.update(out.num_scheduled_tokens)
    raise AssertionError(f"not idle: {list(core.scheduler.requests)}")


def _refusals(deltas: list[protocol.RequestOutputDelta]) -> dict[str, str]:
    return {delta.request_id: delta.error_type for delta in deltas if delta.error is not None}


@pytest.mark.parametrize("order", [[0, 1, 2], [1, 0, 2], [1, 2, 0]])  # sample 0 resent after a cache miss: later
def test_a_refused_sample_0_refuses_its_siblings_wherever_they_are(monkeypatch: pytest.MonkeyPatch,
                                                                    order: list[int]) -> None:
    core, sent = _busy_core(monkeypatch)
    _send_samples(core, order)
    assert _refusals(sent) == dict.fromkeys(SAMPLES, "EngineOverloadedError")
    assert len({delta.error for delta in sent}) == 1 and "n=3" in sent[0].error  # sample 0's error, for each
    assert [r.request_id for r in core.scheduler.waiting] == [request_key(b"h", "w")]
    core._handle(b"h", protocol.AbortRequests(SAMPLES[1:]))  # the host's abort, after sample 0's error
    assert core.samples._refused == {}
    _send(core, "after")  # served as before
    assert _run_to_idle(core) == {request_key(b"h", r) for r in ("busy", "w", "after")}
    stats = core.scheduler.get_stats()
    assert core.scheduler.requests == {} and stats.num_used_blocks == 0 and stats.num_requests_waiting == 0


def test_grammar_samples_admitted_together_are_refused_together(monkeypatch: pytest.MonkeyPatch) -> None:
    core, sent = _busy_core(monkeypatch)
    _send_samples(core, [1, 0, 2], StructuredOutputs(choice=["x"]))  # parked until their grammar compiles
    assert sent == [] and len(core.structured.pending) == 3
    failed = core.samples.admit_compiled()
    assert _refusals([delta for _, delta in failed]) == {request_key(b"h", s): "EngineOverloadedError" for s in SAMPLES}
    assert not core.structured.pending and not core.structured.matchers and core.samples._refused == {}
    assert [r.request_id for r in core.scheduler.waiting] == [request_key(b"h", "w")]


def test_the_siblings_still_to_come_are_forgotten_with_their_host(monkeypatch: pytest.MonkeyPatch) -> None:
    core, sent = _busy_core(monkeypatch)
    _send(core, SAMPLES[0], 3)
    assert set(core.samples._refused) == {request_key(b"h", s) for s in SAMPLES[1:]}
    core._handle(b"h", protocol.Goodbye())
    assert core.samples._refused == {} and core.scheduler.requests == {}


def test_a_cache_miss_or_an_id_in_use_refuses_the_sample_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A miss is no refusal (the host resends the sample with its data); an id in use names another request's
    samples, which must run on."""
    core, sent = _core(monkeypatch, [0.0])
    key = request_key(b"h", SAMPLES[0])
    miss = core.samples.refuse(b"h", key, 3, MultiModalCacheMiss("mm_items[0]", "not cached"))
    assert [delta.request_id for delta in miss] == [key] and core.samples._refused == {}
    _send_samples(core, [0, 1, 2])
    _send_samples(core, [0])  # the same id again: refused alone
    assert _refusals(sent) == {SAMPLES[0]: "InvalidRequestError"}
    assert set(core.scheduler.requests) == {request_key(b"h", s) for s in SAMPLES} and core.samples._refused == {}
    assert sibling_ids("x#2-0", 3) == ["x#2-1", "x#2-2"] and sibling_ids("x#2-1", 0) == sibling_ids("x#2", 1) == []



def test_the_hosts_abort_forgets_the_siblings_not_yet_come(monkeypatch: pytest.MonkeyPatch) -> None:
    core, sent = _busy_core(monkeypatch)
    _send(core, SAMPLES[0], 3)
    assert _refusals(sent) == {SAMPLES[0]: "EngineOverloadedError"} and len(core.samples._refused) == 2
    core._handle(b"h", protocol.AbortRequests(SAMPLES[1:]))  # before they come
    assert core.samples._refused == {}
    _send_samples(core, [1, 2])  # a late sample after its abort: not refused by a stale entry
    assert set(_refusals(sent)) == {SAMPLES[0]}


@pytest.mark.parametrize("refused", [True, False])
def test_a_resent_sample_0_remembers_no_sibling(monkeypatch: pytest.MonkeyPatch, refused: bool) -> None:
    """Sample 0 missed the processor cache; its siblings came after it and finished; its host resends it. Refused,
    it leaves nothing for siblings that will never come again (the host's abort names no finished one)."""
    core, sent = _core(monkeypatch, [0.0], max_num_queued_requests=2, max_num_seqs=1)
    key = request_key(b"h", SAMPLES[0])
    core.samples.refuse(b"h", key, 3, MultiModalCacheMiss("mm_items[0]", "not cached"))
    _send_samples(core, [1, 2])
    assert _run_to_idle(core) == {request_key(b"h", s) for s in SAMPLES[1:]}
    if refused:
        _send(core, "busy")
        run_step(core.scheduler)
        _send(core, "w")
    _send_samples(core, [0])  # resent
    assert _refusals(sent) == ({SAMPLES[0]: "EngineOverloadedError"} if refused else {})
    assert core.samples._refused == {} and core.samples._missed == core.samples._resent == set()


@pytest.mark.parametrize("num_samples", [-1, MAX_N + 1, 2**40])
def test_a_num_samples_out_of_bounds_is_refused_and_never_expanded(monkeypatch: pytest.MonkeyPatch,
                                                                    num_samples: int) -> None:
    """Another host is an untrusted peer: a sample 0 claiming 2**40 samples must neither hang the core nor fill it,
    refused for that field or another (arrival_time)."""
    core, sent = _core(monkeypatch, [0.0])
    _send(core, SAMPLES[0], num_samples)
    core._handle(b"h", protocol.AddRequest("x#1-0", [1, 2, 3], SamplingParams(max_tokens=2), [2], float("nan"),
                                           num_samples=num_samples))
    assert _refusals(sent) == {SAMPLES[0]: "InvalidRequestError", "x#1-0": "InvalidRequestError"}
    assert sent[0].error.startswith("num_samples: ") and f"{MAX_N}" in sent[0].error
    assert core.scheduler.requests == {} and core.samples._refused == {}


def test_sample_0_of_max_n_refuses_its_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    core, sent = _busy_core(monkeypatch)
    _send(core, "m#1-0", MAX_N)
    assert len(core.samples._refused) == MAX_N - 1 and sibling_ids("m#1-0", MAX_N + 1) == []


@pytest.mark.parametrize("refused", [True, False])
def test_a_resent_sample_0_parked_for_its_grammar_remembers_no_sibling(monkeypatch: pytest.MonkeyPatch,
                                                                       refused: bool) -> None:
    core, sent = _core(monkeypatch, [0.0], max_num_queued_requests=2, max_num_seqs=1)
    grammar = StructuredOutputs(choice=["x"])
    core.samples.refuse(b"h", request_key(b"h", SAMPLES[0]), 3, MultiModalCacheMiss("mm_items[0]", "not cached"))
    _send_samples(core, [1, 2], grammar)
    assert core.samples.admit_compiled() == []
    _run_to_idle(core)
    if refused:
        _send(core, "busy")
        run_step(core.scheduler)
        _send(core, "w")
    _send_samples(core, [0], grammar)  # resent, parked
    assert core.samples._resent == {request_key(b"h", SAMPLES[0])}
    failed = core.samples.admit_compiled()
    expected = {request_key(b"h", SAMPLES[0]): "EngineOverloadedError"} if refused else {}
    assert _refusals([delta for _, delta in failed]) == expected
    assert core.samples._refused == {} and core.samples._missed == core.samples._resent == set()
