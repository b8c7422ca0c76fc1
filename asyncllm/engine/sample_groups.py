"""The engine core refuses an n > 1 request's samples together.

The host sends an n > 1 request as n core requests ``<id>#<k>-<i>`` (`sample_ids`), sample 0 first and counting for
all n (`protocol.AddRequest.num_samples`), the others for none: the queue's limits check sample 0 alone. When the
core refuses sample 0 (a queue limit, a prompt it cannot run, ...), its other samples are refused with the same
error: those already here (a sample 0 resent after a processor-cache miss may come after them; a grammar's samples
are admitted together) end at once, those on their way are refused as they arrive (`check`), never queued, and the
host's abort of them, which follows its sample 0's error, forgets the rest. None waits for that abort in the queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm import errors, protocol
from asyncllm.engine.request_keys import host_tag
from asyncllm.mm.cache import MultiModalCacheMiss

if TYPE_CHECKING:
    from asyncllm.engine.core import EngineCore

__all__ = ["SampleGroups", "refusal", "sample_ids", "sibling_ids"]

Refusal = errors.InvalidRequestError | errors.EngineOverloadedError


def sample_ids(base: str, n: int) -> list[str]:
    """The core request ids of a request's n samples: ``base`` when n == 1, else ``<base>-<i>``."""
    return [base] if n == 1 else [f"{base}-{i}" for i in range(n)]


def sibling_ids(sample0: str, num_samples: int) -> list[str]:
    """The ids (or core keys) of the other samples of the n > 1 request whose sample 0 is `sample0`, counting for
    `num_samples`; [] for any other request."""
    base, dash, index = sample0.rpartition("-")
    return sample_ids(base, num_samples)[1:] if num_samples > 1 and dash and index == "0" else []


def refusal(request_id: str, exc: Refusal) -> protocol.RequestOutputDelta:
    """The delta that tells a host its request was refused: its typed error."""
    return protocol.RequestOutputDelta(request_id, [], "abort", error=str(exc), error_type=type(exc).__name__)


class SampleGroups:
    """The core's refused n > 1 requests: each sample still on its way (its key) -> its sample 0's error."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._refused: dict[str, Refusal] = {}

    def check(self, key: str) -> None:
        """Raise the error of this arriving sample's sample 0, if that was refused."""
        refused = self._refused.pop(key, None) if self._refused else None
        if refused is not None:
            raise refused

    def forget(self, keys: list[str]) -> None:
        """These requests were aborted (their host had its sample 0's error): none of them is still to come."""
        for key in keys if self._refused else ():
            self._refused.pop(key, None)

    def forget_client(self, client_id: bytes) -> None:
        tag = host_tag(client_id)
        self._refused = {key: exc for key, exc in self._refused.items() if not key.startswith(tag)}

    def refuse(self, client_id: bytes, key: str, num_samples: int, exc: Refusal) -> list[protocol.RequestOutputDelta]:
        """Request `key`, counting for `num_samples`, was refused with `exc`: its deltas (by key) and, when it is
        sample 0, its siblings'. Those here are aborted, the others are refused when they come (`check`). Not for a
        processor-cache miss (the host resends the sample) nor a request id in use (its siblings' ids name the
        samples of the request that uses it; they are refused as they come, by the same check)."""
        if isinstance(exc, MultiModalCacheMiss) or getattr(exc, "field", None) == "request_id":
            return [refusal(key, exc)]
        siblings = sibling_ids(key, num_samples)
        core = self._core
        here = [other for other in siblings if other in core.scheduler.requests or other in core.structured.pending]
        core.abort(client_id, here)
        self._refused.update((sibling, exc) for sibling in siblings if sibling not in here)
        return [refusal(key, exc), *(refusal(sibling, exc) for sibling in here)]
