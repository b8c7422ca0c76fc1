"""The core tells each host how many samples of its requests it queued (`SchedulerStats.host_samples_queued`), the
count the host's admission estimate takes its requests in flight off by (asyncllm/engine/admission.py). Driven through
`EngineCore._handle` without workers, as tests/unit/test_core_validation.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

from asyncllm import SamplingParams, protocol
from test_core_validation import _add, _core


def _snapshots(core) -> dict[bytes, int]:
    """Each host's `host_samples_queued` as it goes on the wire (`send_outputs` sets it per host, then encodes)."""
    wire: dict[bytes, int] = {}
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(protocol.Outputs)
    io, core.io = core.io, SimpleNamespace(send=lambda client, message: wire.__setitem__(
        client, decoder.decode(encoder.encode(message)).stats.host_samples_queued))
    core.weights, core.sleep = SimpleNamespace(weights_version=0), SimpleNamespace(sleep_level=0, awaiting_weights=False)
    core.send_outputs([])
    core.io = io
    return wire


def test_each_host_gets_its_own_count_of_samples_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    core, sent = _core(monkeypatch, [0.0], max_num_queued_requests=4)
    core.clients.add(b"g")
    assert _snapshots(core) == {b"h": 0, b"g": 0}
    _add(core, "a")
    for index in range(3):  # an n = 3 request: sample 0 counts for all three, as the host counts it
        core._handle(b"g", protocol.AddRequest(f"b#1-{index}", [4, 5], SamplingParams(max_tokens=8), [2], time.time(),
                                               num_samples=0 if index else 3))
    _add(core, "a")  # refused (its id is in use): never queued, never counted
    _add(core, "c", num_samples=2)  # 4 waiting: refused by the queue's limit, not counted
    assert [d.request_id for d in sent] == ["a", "c"]
    assert _snapshots(core) == {b"h": 1, b"g": 3}
    core._handle(b"g", protocol.AbortRequests(["b#1-0", "b#1-1", "b#1-2"]))
    assert _snapshots(core) == {b"h": 1, b"g": 3}  # a count of what was queued, ever: it never goes down
    core._remove_client(b"g")
    core.clients.add(b"g")  # (a host of the same id again: counts from 0)
    assert _snapshots(core) == {b"h": 1, b"g": 0}
