"""The structured output manager's compile timeout (asyncllm/structured/manager.py `_check`), without a compile."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from asyncllm import StructuredOutputs, protocol
from asyncllm.structured.manager import StructuredOutputManager, _Pending
from test_structured_unit import _request


def test_a_grammar_queued_behind_others_is_not_timed_by_their_compile() -> None:
    """The compile timeout runs from when a compile thread takes the grammar: one queued while every thread compiles
    other clients' grammars is not failed for their compile time (a few slow schemas timed out everyone's)."""
    manager = StructuredOutputManager("unused", 512, compile_timeout_s=30.0)
    manager._compilers = SimpleNamespace(ready_since=0.0)  # type: ignore[assignment]
    entry = _Pending(_request("r", StructuredOutputs(regex="a")), Future(), submitted_at=0.0)
    assert manager._check(entry, 100.0) is None  # queued for 100 s: not timed
    assert entry.future.set_running_or_notify_cancel()
    assert manager._check(entry, 101.0) is None and entry.compiling_since == 101.0
    assert manager._check(entry, 130.0) is None
    error = manager._check(entry, 131.0)
    assert error is not None and "grammar compilation timed out after 30.0 s" in str(error)


def test_a_grammars_request_is_queued_when_parked_not_when_its_grammar_is_ready() -> None:
    """Queue time counts the grammar's compile, as vLLM's (its QUEUED event is recorded when the core takes the
    request, before the compile): the parked request's QUEUED is the one its metrics read, and the scheduler's
    `add_request` after the compile records no second one."""
    from test_scheduler import make_scheduler

    manager = StructuredOutputManager("unused", 512, compile_timeout_s=30.0)
    manager._compilers = SimpleNamespace(submit=lambda *args: Future())  # type: ignore[assignment]
    request = _request("r", StructuredOutputs(regex="a"))
    manager.add(request)
    queued = [event for event in request.events or () if event.type == protocol.EngineCoreEventType.QUEUED]
    assert len(queued) == 1
    make_scheduler().add_request(request)  # compiled: the scheduler takes it
    assert [event for event in request.take_events() or ()] == queued
