"""`ProcessorLoRA`: the processor thread's (asyncllm/engine/processor.py) side of LoRA adapters, a mixin.

A request whose adapter id this host has not checked yet waits parked (`_park`) while the `AdapterChecker` checks
it on a thread of its own (`AdapterChecker.checking`: a hub lookup or download, the folder read, the NaN scan), so
this thread streams every other request, adds theirs and handles aborts meanwhile. Requests naming the id meanwhile,
and `AsyncEngine.add_lora` / `pin_lora` of it, share that one check. Once it is done the request goes on where it
stopped (`_resume`: tokenized, sent as any other), or fails alone with the check's `InvalidRequestError`; aborted
while parked it never reaches the core (the check runs on and records the adapter); the engine closed or dead, it
ends as a tracked request does (`_end_parked`). Either way the metrics observer counts it as a tracked request that
ended so (`RequestObserver.on_ended_unsent`). A parked request's id is in use: never forgotten as idle.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING, Any, Container

import zmq

from asyncllm import errors, protocol
from asyncllm.engine.lora_ids import PendingLoRACalls
from asyncllm.engine.processor_outputs import Delivery, TrackedRequest
from asyncllm.lora import LoRARequest
from asyncllm.lora_checker import AdapterChecker
from asyncllm.metrics.observer import RequestObserver
from asyncllm.outputs import StreamDelta

if TYPE_CHECKING:
    from asyncllm.engine.processor_requests import Submit

__all__ = ["ProcessorLoRA"]


class ProcessorLoRA:
    """Mixin of `Processor`: requests parked while their adapter is checked, and the engine's LoRA calls."""

    _lora: AdapterChecker | None
    _tracked: dict[str, TrackedRequest]
    _parked: dict[str, Submit]
    _adding: Submit | None
    _encoder: Any
    _observer: RequestObserver
    _lora_calls: PendingLoRACalls

    if TYPE_CHECKING:
        def _post(self, job: Any) -> None: ...

        def _add_request(self, dealer: zmq.Socket, job: Submit) -> None: ...

        def _send_call(self, calls: Any, message: Any,
                       future: concurrent.futures.Future) -> concurrent.futures.Future: ...

    # ------------------------------------------------------------ requests (the processor thread)
    def _park(self, job: Submit) -> bool:
        """Park `job` while its adapter, new here, is checked off this thread (`_resume` goes on with it); False: it
        names none, or its check's outcome is known already (a checked id's: `_checked_lora` takes it)."""
        request = job.options.lora_request
        if request is None or self._lora is None or job.lora_check is not None:
            return False
        job.lora_check = check = self._lora.checking(request)  # done at once for a checked id: nothing read here
        if check.done():
            return False
        self._parked[job.collector.request_id] = job
        check.add_done_callback(lambda _: self._post(("lora_checked", job)))  # on the checking thread
        return True

    def _resume(self, dealer: zmq.Socket, job: Submit) -> None:
        """`job`'s adapter check is done: add it as any request, unless it was aborted (or ended) while parked."""
        if self._parked.get(job.collector.request_id) is not job:
            return
        del self._parked[job.collector.request_id]
        self._adding = job
        self._add_request(dealer, job)
        self._adding = None

    def _unpark(self, request_id: str) -> None:
        """An abort: a parked request is dropped, never sent (the loop ended its collector already), and counted
        aborted as a sent request is (`RequestObserver.on_ended_unsent`)."""
        job = self._parked.pop(request_id, None)
        if job is not None:
            self._observer.on_ended_unsent(job, None, time.time())

    def _checked_lora(self, job: Submit) -> LoRARequest | None:
        """The request's adapter as checked: its parked check's outcome (raising its error; recorded again should the
        id have been forgotten as idle since: nothing is read here); None for none."""
        request = job.options.lora_request
        if request is None:
            return None
        if job.lora_check is None or self._lora is None:
            raise _no_lora()
        return self._lora.check(request, job.lora_check.result())

    def _end_parked(self, error: BaseException | None) -> Delivery:
        """`_fail_all`: every parked request ends, with `error`, or (None: a close) each sample aborted."""
        batch: Delivery = []
        now = time.time()
        for job in self._parked.values():
            self._observer.on_ended_unsent(job, error, now)  # counted as a sent request ending so
            if error is not None:
                batch.append((job.collector, error))
                continue
            logprob = None if job.params.logprobs is None else 0.0
            batch.extend((job.collector, StreamDelta(index, "", [], "abort", cumulative_logprob=logprob))
                         for index in range(job.params.n))
        self._parked.clear()
        return batch

    def _forget_idle_loras(self, dealer: zmq.Socket) -> None:
        """Past its bound, the checker forgets the least recently used adapter ids no tracked or parked request runs
        with (`AdapterChecker.forget_idle`); the core forgets each too (a `RemoveLoRA` no caller waits on: its answer
        resolves nothing), before any later request checks it afresh, maybe for another folder."""
        if self._lora is None:
            return
        for lora_int_id in self._lora.forget_idle(lambda: {
                *(tracked.lora_int_id for tracked in self._tracked.values()),
                *(job.options.lora_request.lora_int_id for job in self._parked.values())}):  # (parked: one)
            dealer.send(self._encoder.encode(protocol.RemoveLoRA("", lora_int_id)))

    # ------------------------------------------------------------ the engine's calls (any thread)

    def checking_lora(self, request: LoRARequest) -> concurrent.futures.Future[LoRARequest]:
        """`AsyncEngine.add_lora`, `pin_lora`: the future of `request`'s check, off the calling thread, shared with
        the requests parked on the same adapter (`AdapterChecker.checking`)."""
        if self._lora is not None:
            return self._lora.checking(request)
        future: concurrent.futures.Future[LoRARequest] = concurrent.futures.Future()
        future.set_exception(_no_lora())
        return future

    def lora_call(self, message: protocol.AddLoRA | protocol.RemoveLoRA | protocol.PinLoRA
                  ) -> concurrent.futures.Future[Any]:
        """Send `AddLoRA` or `PinLoRA` (the adapter as checked) or `RemoveLoRA`, its call_id set here, after every
        request submitted before; the future of the core's answer (None, True once pinned, or whether it knew the
        removed id)."""
        message.call_id, future = self._lora_calls.new()
        return self._send_call(self._lora_calls, message, future)

    def lora_ids(self) -> set[int]:
        """`AsyncEngine.list_loras`: the adapter ids checked and not forgotten since."""
        return set() if self._lora is None else self._lora.ids()

    def forget_lora(self, lora_int_id: int) -> bool:
        """`AsyncEngine.remove_lora`: the adapter id is checked again when used again; whether it was known."""
        return self._lora is not None and self._lora.forget(lora_int_id)

    def lora_given(self, lora_int_id: int) -> LoRARequest | None:
        """`AsyncEngine.pin_lora`: the adapter of a checked id, as given; None for an id this replica does not know."""
        return None if self._lora is None else self._lora.given(lora_int_id)

    def remember_lora(self, given: LoRARequest, checked: LoRARequest) -> None:
        """A restarted core's pinned adapter (`EnginePins.pin_again`): known again as checked before, nothing read."""
        if self._lora is not None:
            self._lora.check(given, checked)

    def adopt_loras(self, before: "ProcessorLoRA") -> None:
        """A restarted core's new processor: the host's record of adapters (`AdapterChecker`: the ids checked, pinned,
        being checked) is the dead processor's, not an empty one: the host outlived its core, so `list_loras` stays as
        before the crash and the new core is told them (`add_loras_again`; the pinned ones `EnginePins.pin_again`)."""
        if self._lora is not None and before._lora is not None:
            self._lora = before._lora

    def add_loras_again(self, skip: Container[int]) -> list[tuple[LoRARequest, concurrent.futures.Future[Any]]]:
        """A restarted core: an `AddLoRA` for each adapter id this host knows but those in `skip` (pinned: pinned
        again), least recently used first, as checked before (nothing read here), sent now, before any request can
        reach the core; each adapter as given with the future of the core's answer."""
        if self._lora is None:
            return []
        return [(given, self.lora_call(protocol.AddLoRA("", checked))) for given, checked in self._lora.known()
                if given.lora_int_id not in skip]

    def pin_lora_id(self, lora_int_id: int, pinned: bool = True) -> None:
        """`AsyncEngine.pin_lora`: a pinned id is never forgotten as idle (``pinned`` False: it may be again)."""
        if self._lora is not None:
            self._lora.pin(lora_int_id, pinned)


def _no_lora() -> errors.InvalidRequestError:
    return errors.InvalidRequestError("lora_request", "this engine serves no LoRA adapters: start it with "
                                                      "enable_lora=True")
