"""A CPU stand-in for CUDA graphs: `install` makes `CudaGraphRunner.capture_one` record the captured call, and a
`RecordedGraph`'s replay runs it again on the tensors it was captured with, writing the outputs the capture returned
(what a replayed CUDA graph does: it reads its inputs where they were at capture, whatever was written there since)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncllm.workers.cuda_graphs import CudaGraphRunner

__all__ = ["RecordedGraph", "install"]


class RecordedGraph:
    """A captured call: ``replay`` runs it again and writes its outputs into the ones the capture returned."""

    def __init__(self, run: Any, out: Any) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        fresh = self.run()
        for static, new in zip(*(o if isinstance(o, tuple) else (o,) for o in (self.out, fresh))):
            static.copy_(new)


def _record(pool: Any, run: Any) -> tuple[RecordedGraph, Any]:
    out = run()
    return RecordedGraph(run, out), out


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CudaGraphRunner, "capture_one", staticmethod(_record))
    for name in ("graph_pool_handle", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
