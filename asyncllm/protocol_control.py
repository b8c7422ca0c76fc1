"""Control calls between host, engine core and workers: weight updates, sleep mode and LoRA adapters added ahead,
and typed errors on the wire.

Part of the wire protocol (asyncllm/protocol.py, which re-exports every name here): a call goes host -> core ->
every worker rank (`UpdateWeights`, `Sleep`, `WakeUp`; `AwaitWeights` to a restarted core only), its answer
rank -> core -> host (`WeightsUpdated`, `SleepModeDone`); `AddLoRA` and `RemoveLoRA` go to the core only, answered
by `LoRAAdded` and `LoRARemoved` (asyncllm/engine/lora_ids.py); `PinLoRA` goes host -> core -> every worker rank,
answered by `LoRAPinned` (asyncllm/engine/core_lora.py); a refused call's error as ``error_*`` fields
(`call_error_fields` / `call_error`), a ConfigError as [field, value repr, allowed] with its class as the message's
``error_type`` (`config_error_parts`; a NotBuiltError stays one, its rank note after its sentence), a worker's
`WorkerError` as the core raises it (`worker_failure`).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

import msgspec

from asyncllm.errors import AsyncLLMError, ConfigError, EngineDeadError, InvalidRequestError, NotBuiltError
from asyncllm.lora import LoRARequest

if TYPE_CHECKING:
    from asyncllm.protocol_worker import WorkerError

__all__ = [
    "WeightTensor", "UpdateWeights", "AwaitWeights", "Sleep", "WakeUp", "WeightsUpdated", "SleepModeDone",
    "AddLoRA", "LoRAAdded", "RemoveLoRA", "LoRARemoved", "PinLoRA", "LoRAPinned", "config_error_parts",
    "config_error_from_parts", "call_error_fields", "call_error", "worker_failure",
]

_STRUCT = dict(tag=True, array_like=True, omit_defaults=True)
"""The tagged messages' options (every module of the wire protocol): the tag is the class name."""


# ---------------------------------------------------------------- host -> core -> workers
class WeightTensor(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of `update_weights_from_tensors` in the host's shared-memory segment: its checkpoint name, torch
    dtype name ("bfloat16"), shape, and byte offset in the segment (contiguous, row-major)."""

    name: str
    dtype: str
    shape: list[int]
    offset: int


class UpdateWeights(msgspec.Struct, **_STRUCT):
    """Reload every weight of the served model in place from ``model_path``, or the weights in ``tensors`` from the
    host's shared-memory ``segment`` (docs/weight-updates.md): the core runs it between steps, after the requests
    the host sent before it; the core passes it on to every worker rank."""

    update_id: str
    model_path: str
    revision: str | None = None
    hf_config_json: str = ""
    """The new checkpoint's config as the host read it (`hf_config_json`; empty: each worker reads it)."""
    segment: str = ""
    """`update_weights_from_tensors`: the /dev/shm segment holding ``tensors`` (``model_path`` is empty)."""
    tensors: list[WeightTensor] = []
    weights_version: int = 0
    """The version to take on success: a restarted core replaying the host's last update keeps its number (0: one
    more than the core's)."""

    def source(self) -> str:
        """What the update loads, for logs and errors."""
        return f"{len(self.tensors)} tensors from the host" if self.segment else repr(self.model_path)


class AwaitWeights(msgspec.Struct, **_STRUCT):
    """To a restarted core whose host last pushed weights from memory (docs/weight-updates.md): those weights died
    with the old core, so it runs no step until updates write every weight again; it is at ``weights_version``."""

    weights_version: int


class Sleep(msgspec.Struct, **_STRUCT):
    """vLLM's sleep mode (docs/sleep-mode.md): free the GPU memory of the weights (level 1: kept in CPU memory;
    level 2: discarded) and of the KV cache. The core runs it between steps, after the host's earlier messages,
    and passes it on to every worker rank."""

    call_id: str
    level: int = 1
    tags: list[str] = []
    """Core -> workers only: the parts to put to sleep ("weights", "kv_cache"); empty: both."""


class WakeUp(msgspec.Struct, **_STRUCT):
    """Take the memory back (docs/sleep-mode.md): the parts named in ``tags`` ("weights", "kv_cache"); empty: all."""

    call_id: str
    tags: list[str] = []


# ---------------------------------------------------------------- workers -> core -> host
class WeightsUpdated(msgspec.Struct, **_STRUCT):
    """The answer to `UpdateWeights`: from each worker rank to the core, and from the core to the host that asked.

    ``error_type`` empty: it succeeded. Otherwise nothing was copied, and the error is rebuilt from
    ``error_type`` (InvalidRequestError or NotBuiltError), ``error_field``, ``error_value`` and ``error``.
    """

    update_id: str
    weights_version: int = 0
    """The core's weights version after the update (core -> host only)."""
    rank: int = 0
    weights_unwritten: int = 0
    """Worker -> core: how many of this rank's weights nothing has written since they stopped being real (a
    level-2 sleep, dummy weights); partial `update_weights_from_tensors` calls count down to 0."""
    error_type: str = ""
    error_field: str = ""
    error_value: str = ""
    """NotBuiltError only: the refused value (a str: a field's name or a path)."""
    error: str = ""
    """InvalidRequestError's message, NotBuiltError's feature."""


class SleepModeDone(msgspec.Struct, **_STRUCT):
    """The answer to `Sleep` or `WakeUp`: from each worker rank to the core, and from the core to the host.

    ``error_type`` empty: it was done. Otherwise nothing changed, and the error is rebuilt from ``error_type``
    (ConfigError, InvalidRequestError or NotBuiltError), ``error_field``, ``error_value`` and ``error``
    (asyncllm/engine/sleep.py).
    """

    call_id: str
    rank: int = 0
    sleep_level: int = 0
    """The core's `SchedulerStats.sleep_level` after the call (core -> host only)."""
    error_type: str = ""
    error_field: str = ""
    error_value: str = ""
    error: str = ""
    """InvalidRequestError's message, NotBuiltError's feature, ConfigError's allowed values."""


# ---------------------------------------------------------------- host <-> core
class AddLoRA(msgspec.Struct, **_STRUCT):
    """`AsyncEngine.add_lora` at the core: the adapter as the host checked it (``lora_path`` a local folder)."""

    call_id: str
    lora: LoRARequest


class LoRAAdded(msgspec.Struct, **_STRUCT):
    """The answer to `AddLoRA`: ``error_type`` empty: the core took the host's id for the folder; otherwise the
    refusal (InvalidRequestError naming ``lora_path`` or ``lora_request``)."""

    call_id: str
    error_type: str = ""
    error_field: str = ""
    error_value: str = ""
    error: str = ""


class RemoveLoRA(msgspec.Struct, **_STRUCT):
    """`AsyncEngine.remove_lora` at the core: forget the host's ``lora_int_id`` (its requests running go on)."""

    call_id: str
    lora_int_id: int


class LoRARemoved(msgspec.Struct, **_STRUCT):
    """The answer to `RemoveLoRA`: whether the core knew the host's id; ``error_type`` set only for a host the core
    does not know (EngineDeadError)."""

    call_id: str
    removed: bool = False
    error_type: str = ""
    error_field: str = ""
    error_value: str = ""
    error: str = ""


class PinLoRA(msgspec.Struct, **_STRUCT):
    """`AsyncEngine.pin_lora` (vLLM's): host -> core, the adapter as the host checked it (the core binds its id as
    for `AddLoRA`, then pins it); core -> every worker rank, under its core id: read it now and keep it in a slot
    and the CPU cache, never evicted. ``unpin`` (core -> workers: `remove_lora` of a pinned id, or its host gone;
    host -> core: its `pin_lora` refused by another replica, the id left bound): evictable again, the first to go."""

    call_id: str
    lora: LoRARequest
    unpin: bool = False


class LoRAPinned(msgspec.Struct, **_STRUCT):
    """The answer to `PinLoRA`: from each worker rank to the core, and from the core to the host. ``error_type``
    empty: pinned; otherwise nothing was pinned, and the error is rebuilt as `call_error` does (InvalidRequestError
    naming the reason: no slot left to pin, an adapter the workers cannot read; EngineDeadError)."""

    call_id: str
    rank: int = 0
    error_type: str = ""
    error_field: str = ""
    error_value: str = ""
    error: str = ""


# ------------------------------------------------------------- error helpers
def config_error_parts(exc: BaseException) -> list[str]:
    """A ConfigError as [field, value repr, allowed] for the wire (a NotBuiltError: [field, value repr, feature,
    where]); [] for anything else. The class goes as the message's ``error_type``."""
    if isinstance(exc, NotBuiltError):
        return [exc.field, exc.value_repr, exc.feature, exc.where]
    if isinstance(exc, ConfigError):
        return [exc.field, exc.value_repr, exc.allowed]  # not repr(value): a re-sent error is not quoted twice
    return []


def config_error_from_parts(parts: list[str], where: str = "", *,
                            error_type: str = "ConfigError") -> ConfigError | None:
    """Rebuild the ConfigError (a NotBuiltError when ``error_type`` names it) sent with `config_error_parts`; None
    if there is none."""
    if len(parts) not in (3, 4):
        return None
    field, value_repr, allowed, *sent_where = parts
    if error_type == "NotBuiltError":
        return NotBuiltError(field, _literal(value_repr), allowed, value_repr=value_repr,
                             where="".join(sent_where) + where)
    return ConfigError(field, _literal(value_repr), allowed + where, value_repr=value_repr)


def worker_failure(message: "WorkerError") -> AsyncLLMError:
    """What a worker's `WorkerError` raises in the core: its ConfigError stays a ConfigError (same field, a
    NotBuiltError a NotBuiltError); anything else kills the engine."""
    config_error = config_error_from_parts(message.config_error, f" (worker rank {message.rank})",
                                           error_type=message.error_type)
    if config_error is not None:
        return config_error
    kind = f"{message.error_type}: " if message.error_type else ""
    return EngineDeadError(f"worker rank {message.rank} failed: {kind}{message.message}")


def _literal(value_repr: str) -> object:
    """The value a repr stands for where it is a Python literal (a str, a number, a list ...), else the repr."""
    try:
        return ast.literal_eval(value_repr)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value_repr


def call_error_fields(exc: AsyncLLMError) -> dict[str, str]:
    """A refused call's typed error as the ``error_*`` fields `WeightsUpdated` and `SleepModeDone` carry."""
    if isinstance(exc, NotBuiltError):  # before ConfigError: its subclass; the values refused are str
        return {"error_type": "NotBuiltError", "error_field": exc.field, "error_value": str(exc.value),
                "error": exc.feature}
    if isinstance(exc, ConfigError):
        return {"error_type": "ConfigError", "error_field": exc.field, "error_value": repr(exc.value),
                "error": exc.allowed}
    if isinstance(exc, EngineDeadError):
        return {"error_type": "EngineDeadError", "error": str(exc)}
    assert isinstance(exc, InvalidRequestError), exc
    return {"error_type": "InvalidRequestError", "error_field": exc.field, "error": exc.message}


def call_error(reply: "WeightsUpdated | SleepModeDone | LoRAPinned", default_field: str = "") -> AsyncLLMError | None:
    """The typed error `call_error_fields` sent; None when the call succeeded."""
    if not reply.error_type:
        return None
    if reply.error_type == "NotBuiltError":
        return NotBuiltError(reply.error_field, reply.error_value, reply.error)
    if reply.error_type == "ConfigError":
        return ConfigError(reply.error_field, reply.error_value, reply.error, value_repr=reply.error_value)
    if reply.error_type == "EngineDeadError":
        return EngineDeadError(reply.error)
    return InvalidRequestError(reply.error_field or default_field, reply.error)
