"""The engine core refuses an n > 1 request's samples together.

The host sends an n > 1 request as n core requests ``<id>#<k>-<i>`` (`sample_ids`), sample 0 first and counting for
all n (`protocol.AddRequest.num_samples`, at most `MAX_N`), the others for none, all together: the queue's limits
check sample 0 alone. When the core refuses sample 0 (a queue limit, a prompt it cannot run, ...), its other samples
are refused with the same error: those already here (a grammar's samples are admitted together) end at once, those
on their way are refused as they arrive (`check`), never queued, and the host's abort of them, which follows its
sample 0's error and names every sample still on its way, forgets the rest. None waits for that abort in the queue.

A sample 0 that missed the processor cache is resent by its host after its error, so after all its siblings: when
the resent one is refused, no sibling is still to come (those here end; those finished are not remembered, since
the host's abort would not name them). The core keeps such a sample 0's key from its miss until it comes again,
and then until it is queued, refused, failed or aborted; a host that cannot resend it (an image it cannot read
again) fails the request and aborts it with its siblings (processor_outputs.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm import errors, protocol
from asyncllm.engine.request_keys import host_tag
from asyncllm.engine.validation import MAX_N
from asyncllm.mm.cache import MultiModalCacheMiss

if TYPE_CHECKING:
    from asyncllm.engine.core import EngineCore
    from asyncllm.sched.request import Request

__all__ = ["SampleGroups", "refusal", "sample_ids", "sibling_ids"]

Refusal = errors.InvalidRequestError | errors.EngineOverloadedError


def sample_ids(base: str, n: int) -> list[str]:
    """The core request ids of a request's n samples: ``base`` when n == 1, else ``<base>-<i>``."""
    return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


def sibling_ids(sample0: str, num_samples: int) -> list[str]:
    """The ids (or core keys) of the other samples of the n > 1 request whose sample 0 is `sample0`, counting for
    `num_samples`; [] for any other request, and for a count over `MAX_N` (the core refuses it: never expanded)."""
    base, dash, index = sample0.rpartition("-")
    return sample_ids(base, num_samples)[1:] if 1 < num_samples <= MAX_N and dash and index == "0" else []


def refusal(request_id: str, exc: Refusal) -> protocol.RequestOutputDelta:
    """The delta that tells a host its request was refused: its typed error."""
    return protocol.RequestOutputDelta(request_id, [], "abort", error=str(exc), error_type=type(exc).__name__)


class SampleGroups:
    """The core's refused n > 1 requests: each sample still on its way (its key) -> its sample 0's error."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._refused: dict[str, Refusal] = {}
        self._missed: set[str] = set()
        """Sample 0s (n > 1) refused for a processor-cache miss: their host resends each after all its siblings."""
        self._resent: set[str] = set()
        """Resent ones (`_missed`) come again, being added or parked for their grammar: no sibling is to come."""
        self.queued: dict[bytes, int] = {}
        """Each host's samples (`Request.num_samples`) queued or parked so far: its `SchedulerStats.host_samples_queued`
        (asyncllm/engine/admission.py)."""

    def check(self, key: str) -> None:
        """A sample arrives: raise the error of its sample 0, if that was refused."""
        if key in self._missed:
            self._missed.discard(key)
            self._resent.add(key)
        self._raise_refused(key)

    def _raise_refused(self, key: str) -> None:
        refused = self._refused.pop(key, None) if self._refused else None
        if refused is not None:
            raise refused

    def queue(self, request: Request) -> None:
        """Queue a checked request, or park it until its grammar has compiled (`admit_compiled`)."""
        if request.params.structured is not None:
            self._core.structured.add(request)
        else:
            self._core.scheduler.add_request(request)
            self._resent.discard(request.request_id)
        self.queued[request.client_id] = self.queued.get(request.client_id, 0) + request.num_samples

    def admit_compiled(self) -> list[tuple[bytes, protocol.RequestOutputDelta]]:
        """Queue the requests whose grammar is ready; error deltas for those that failed or timed out."""
        core = self._core
        ready, failed = core.structured.poll()
        for request in ready:
            try:
                self._raise_refused(request.request_id)
                core.scheduler.add_request(request)
            except (errors.InvalidRequestError, errors.EngineOverloadedError) as exc:
                core.structured.matchers.pop(request.request_id, None)
                refused = self.refuse(request.client_id, request.request_id, request.num_samples, exc)
                failed += [(request.client_id, delta) for delta in refused]
        if self._resent:
            self._resent.difference_update([r.request_id for r in ready] + [delta.request_id for _, delta in failed])
        return failed

    def forget(self, keys: list[str]) -> None:
        """These requests were aborted (their host had its sample 0's error, or its own abort): none of them is still
        to come, nor the resend of their sample 0."""
        if self._refused or self._missed or self._resent:
            for key in keys:
                self._refused.pop(key, None)
                self._missed.discard(key)
                self._resent.discard(key)

    def forget_client(self, client_id: bytes) -> None:
        self.queued.pop(client_id, None)
        tag = host_tag(client_id)
        self._refused = {key: exc for key, exc in self._refused.items() if not key.startswith(tag)}
        self._missed = {key for key in self._missed if not key.startswith(tag)}
        self._resent = {key for key in self._resent if not key.startswith(tag)}

    def refuse(self, client_id: bytes, key: str, num_samples: int, exc: Refusal) -> list[protocol.RequestOutputDelta]:
        """Request `key`, counting for `num_samples`, was refused with `exc`: its deltas (by key) and, when it is
        sample 0, its siblings'. Those here are aborted, the others are refused when they come (`check`), unless it
        was resent (`_resent`). Alone for a request id in use (its siblings' ids name the samples of the request
        that uses it; they are refused as they come, by the same check) and for a processor-cache miss (the host
        resends the sample: remembered in `_missed`)."""
        if getattr(exc, "field", None) == "request_id":
            return [refusal(key, exc)]
        siblings = sibling_ids(key, num_samples)
        resent = key in self._resent
        self._resent.discard(key)
        if isinstance(exc, MultiModalCacheMiss):
            if siblings:
                self._missed.add(key)
            return [refusal(key, exc)]
        core = self._core
        here = [other for other in siblings if other in core.scheduler.requests or other in core.structured.pending]
        core.abort(client_id, here)
        if not resent:
            self._refused.update((sibling, exc) for sibling in siblings if sibling not in here)
        return [refusal(key, exc), *(refusal(sibling, exc) for sibling in here)]
