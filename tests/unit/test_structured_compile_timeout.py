"""The structured output manager's compile timeout (asyncllm/structured/manager.py `_check`), without a compile."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from asyncllm import StructuredOutputs
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
