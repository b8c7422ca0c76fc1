"""The ranks' torch.distributed store (`Worker.rendezvous_store`): rank 0 binds it on a port the kernel gives and
reports that port, which the executor passes to every rank (the executor's relay runs in tests/unit/test_executor.py's
tp=2 tests)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch.distributed as dist

from asyncllm import protocol
from asyncllm.workers import worker as worker_module
from asyncllm.workers.worker import Worker


class _Ring:
    """A broadcast ring reader that holds the given commands."""

    def __init__(self, *commands: protocol.WorkerCommand) -> None:
        self._payloads = [msgspec.msgpack.encode(command) for command in commands]

    def dequeue(self, timeout: float | None = None) -> bytes:
        return self._payloads.pop(0)


def _worker(rank: int, world_size: int, ring: _Ring, sent: list[Any]) -> Worker:
    worker = Worker(SimpleNamespace(rank=rank, world_size=world_size), results=None)  # type: ignore[arg-type]
    worker.reader = ring  # type: ignore[assignment]
    worker.send = sent.append  # type: ignore[method-assign]
    return worker


def test_rank_0_reports_the_port_its_store_bound_and_the_others_join_the_port_passed_on(monkeypatch) -> None:
    monkeypatch.setattr(worker_module, "_DIST_TIMEOUT", timedelta(seconds=5))  # a wrong port fails in seconds
    sent: list[Any] = []
    served = _worker(0, 2, _Ring(protocol.JoinRendezvous(0)), sent).rendezvous_store()  # its own port, unread
    (opened,) = sent
    assert isinstance(opened, protocol.RendezvousOpened) and opened.port == served.port > 0
    joined = _worker(1, 2, _Ring(protocol.JoinRendezvous(opened.port)), sent).rendezvous_store()
    assert sent == [opened]  # only rank 0 reports
    joined.set("from rank 1", "hello")
    assert served.get("from rank 1") == b"hello"


def test_one_rank_meets_nobody_and_the_join_comes_first() -> None:
    sent: list[Any] = []
    assert isinstance(_worker(0, 1, _Ring(), sent).rendezvous_store(), dist.HashStore) and sent == []
    with pytest.raises(RuntimeError, match="expected JoinRendezvous before any other command, got ShutdownWorker"):
        _worker(1, 2, _Ring(protocol.ShutdownWorker()), sent).rendezvous_store()
