"""A host that cannot resend an n > 1 request's sample 0 after its processor-cache miss fails the request, and its
abort names sample 0 too: the core forgets the miss it kept for the resend (asyncllm/engine/sample_groups.py), not
only at the host's disconnect. The processor thread's `_on_delta` driven without a core; its abort fed to one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncllm import errors, protocol
from asyncllm.engine import processor_outputs
from asyncllm.engine.processor import Processor
from asyncllm.engine.processor_outputs import TrackedRequest
from asyncllm.engine.request_keys import request_key
from asyncllm.mm.cache import CACHE_MISS_ERROR, MultiModalCacheMiss
from test_core_validation import _core

SAMPLES = [f"r#1-{i}" for i in range(3)]


def _cannot_resend(*_args) -> None:
    raise errors.InvalidRequestError("image", "cannot be read again")


def _resend_bug(*_args) -> None:
    raise RuntimeError("an unexpected failure")


def _host_aborts(monkeypatch: pytest.MonkeyPatch, unfinished: list[str], resend=_cannot_resend) -> list[str]:
    """Sample 0 of request "r" (n=3) misses; its resend fails. What the host aborts, `unfinished` still tracked."""
    monkeypatch.setattr(processor_outputs, "resend_with_data", resend)
    processor = Processor.__new__(Processor)
    collector = SimpleNamespace(request_id="r")
    processor._tracked = {core_id: TrackedRequest(collector, None, int(core_id[-1])) for core_id in unfinished}
    processor._tracked[SAMPLES[0]].mm_resend = ("add", "prompt")
    processor._samples, processor._ending, processor._mm = {"r": list(unfinished)}, [], object()
    processor._encoder = SimpleNamespace(encode=lambda message: message)
    processor._observer = SimpleNamespace(on_output=lambda *args: None)
    batch: list = []
    aborts: list[str] = []
    miss = protocol.RequestOutputDelta(SAMPLES[0], [], "abort", error="mm_items: not cached",
                                       error_type=CACHE_MISS_ERROR)
    sent: list = []
    processor._on_delta(SimpleNamespace(send=sent.append), miss, 0.0, batch, aborts)
    assert sent == [] and [type(item) for _, item in batch] == [errors.InvalidRequestError] and processor._tracked == {}
    return aborts


@pytest.mark.parametrize("unfinished", [SAMPLES, SAMPLES[:1]])  # siblings running, or finished before the resend
def test_a_failed_resend_aborts_sample_0_and_the_core_forgets_its_miss(monkeypatch: pytest.MonkeyPatch,
                                                                       unfinished: list[str]) -> None:
    core, _ = _core(monkeypatch, [0.0])
    core.samples.refuse(b"h", request_key(b"h", SAMPLES[0]), 3, MultiModalCacheMiss("mm_items[0]", "not cached"))
    assert core.samples._missed == {request_key(b"h", SAMPLES[0])}
    aborts = _host_aborts(monkeypatch, unfinished)
    assert sorted(aborts) == unfinished
    core._handle(b"h", protocol.AbortRequests(aborts))
    assert core.samples._missed == core.samples._resent == set() and core.samples._refused == {}


def test_any_failure_of_a_resend_fails_its_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only an image that cannot be read: whatever the resend raises fails that request, never the processor
    thread every request shares."""
    assert sorted(_host_aborts(monkeypatch, SAMPLES[:1], _resend_bug)) == SAMPLES[:1]
