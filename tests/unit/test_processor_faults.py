"""The processor thread's end against requests posted meanwhile, with forced interleavings and no engine: every
posted Submit is either failed by the ending thread or refused (asyncllm/engine/processor.py)."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest

from asyncllm.engine.processor import Processor, Submit
from asyncllm.errors import EngineDeadError


def _processor(jobs: queue.SimpleQueue) -> tuple[Processor, list]:
    """A `Processor` with only what `_post` and `_fail_queued_requests` use; what it delivers goes to the list."""
    delivered: list = []
    processor = Processor.__new__(Processor)
    processor._jobs, processor.dead, processor._accepting, processor._adding = jobs, None, True, None
    processor._accepting_lock, processor._doorbell_lock = threading.Lock(), threading.Lock()
    processor._doorbell = SimpleNamespace(closed=True)
    processor._deliver = lambda batch, stats: delivered.extend(batch)
    return processor, delivered


def _submit(collector: str) -> Submit:
    job = Submit.__new__(Submit)
    job.collector = collector  # type: ignore[assignment]
    return job


class _ThreadEndsDuringPut(queue.SimpleQueue):
    """The loop is preempted between `_post`'s check and its put: the processor thread dies and drains meanwhile."""

    processor: Processor

    def put(self, job, block=True, timeout=None) -> None:
        def end() -> None:
            self.processor.dead = EngineDeadError("core died")
            self.processor._fail_queued_requests()

        ending = threading.Thread(target=end)
        ending.start()
        ending.join(0.2)  # with the drain sharing `_post`'s lock it waits for this put
        super().put(job)
        self.ending = ending


def test_a_request_posted_as_the_thread_ends_is_failed_not_left_queued() -> None:
    jobs = _ThreadEndsDuringPut()
    processor, delivered = _processor(jobs)
    jobs.processor = processor
    processor._post(_submit("collector-1"))
    jobs.ending.join(5)
    assert [collector for collector, _ in delivered] == ["collector-1"] and jobs.empty()
    assert isinstance(delivered[0][1], EngineDeadError)


def test_a_request_posted_after_a_close_drained_the_jobs_is_refused() -> None:
    processor, delivered = _processor(queue.SimpleQueue())
    processor._fail_queued_requests()  # the thread ended on a normal close: `dead` stays None
    with pytest.raises(EngineDeadError, match="the engine was closed"):
        processor._post(_submit("collector-2"))
    processor._post(("abort", "r"))  # anything else is harmless to leave
    assert delivered == []


def test_a_control_call_made_as_the_thread_ends_fails_at_once() -> None:
    """`add_lora`, `update_weights`, `sleep` register their future, then post: one registered after the ending thread
    failed the pending calls (it is still closing its sockets, so `is_alive` holds) gets the thread's error at once,
    never a future nobody resolves."""
    from asyncllm.engine.lora_ids import PendingLoRACalls
    from asyncllm.engine.sleep import PendingSleepCalls
    from asyncllm.engine.weight_update import PendingWeightUpdates
    from asyncllm.errors import EngineDeadError

    for calls in (PendingLoRACalls(), PendingSleepCalls(), PendingWeightUpdates()):
        _, before = calls.new()
        calls.close(EngineDeadError("the engine was closed"))
        _, after = calls.new()
        for future in (before, after):
            assert future.done() and isinstance(future.exception(), EngineDeadError)
