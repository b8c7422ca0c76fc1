"""Sleep mode, the torch-free half (docs/sleep-mode.md): argument checks, errors on the wire, pending calls.

`AsyncEngine.sleep` / `wake_up` send a `protocol.Sleep` / `protocol.WakeUp`; the core answers each with a
`protocol.SleepModeDone`. A refusal (`ConfigError` naming enable_sleep_mode, `NotBuiltError` for a model whose
memory sleep mode cannot move, `InvalidRequestError`) travels on the wire as the answer's ``error_*`` fields and
`sleep_error` rebuilds it on the host.
"""

from __future__ import annotations

from asyncllm import errors, protocol
from asyncllm.engine.weight_update import PendingWeightUpdates

__all__ = ["SLEEP_LEVELS", "WAKE_TAGS", "PendingSleepCalls", "check_level", "check_tags", "sleep_error",
           "sleep_error_reply"]

SLEEP_LEVELS = (1, 2)
"""1: weights kept in CPU memory, KV cache discarded; 2: both discarded (vLLM's levels)."""
WAKE_TAGS = ("weights", "kv_cache")
"""What `wake_up(tags=...)` can take back, one part at a time (vLLM's tags)."""


def check_level(level: object) -> int:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise errors.InvalidRequestError("level", f"1 (weights offloaded to CPU memory) or 2 (weights discarded), "
                                                  f"got {level!r}")
    return int(level)  # type: ignore[call-overload]


def check_tags(tags: object) -> list[str]:
    """The tags as a list (empty: every part); `InvalidRequestError` naming ``tags`` for anything else."""
    if tags is None:
        return []
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags \
            or any(tag not in WAKE_TAGS for tag in tags):
        raise errors.InvalidRequestError("tags", f"None or a non-empty list of {list(WAKE_TAGS)}, got {tags!r}")
    return sorted(set(tags))


def sleep_error_reply(call_id: str, exc: errors.AsyncLLMError, rank: int = 0) -> protocol.SleepModeDone:
    """The `SleepModeDone` that carries a refusal."""
    return protocol.SleepModeDone(call_id, rank=rank, **protocol.call_error_fields(exc))


def sleep_error(reply: protocol.SleepModeDone) -> errors.AsyncLLMError | None:
    """The typed error of a refused call; None when it was done."""
    return protocol.call_error(reply)


class PendingSleepCalls(PendingWeightUpdates):
    """The processor thread's `Sleep` / `WakeUp` sent and not answered yet; each future gets the core's sleep
    level after the call (0: awake)."""

    @staticmethod
    def _call_id(reply: protocol.SleepModeDone) -> str:  # type: ignore[override]
        return reply.call_id

    @staticmethod
    def _error(reply: protocol.SleepModeDone) -> errors.AsyncLLMError | None:  # type: ignore[override]
        return sleep_error(reply)

    @staticmethod
    def _result(reply: protocol.SleepModeDone) -> int:  # type: ignore[override]
        return reply.sleep_level
