"""The engine core's half of `AsyncEngine.pin_lora` (vLLM's ``pin_lora``; docs/lora.md).

A host's `PinLoRA` binds its id as `AddLoRA` does (asyncllm/engine/lora_ids.py), then, between steps, every worker
rank reads the adapter into its CPU cache and a slot and keeps it there (workers/lora_runner.py); only once every
rank did is the id pinned in the core (`HostLoRAIds.pinned`, which the scheduler counts against ``max_loras``).
A pinned id removed (`RemoveLoRA`), or whose host detached, or unpinned by its host (a `PinLoRA` with ``unpin``: its
`pin_lora` refused by another data-parallel replica), is unpinned on the workers too (`unpin_removed`).
Every refusal names ``lora_id``, `pin_lora`'s only argument (`pin_refusal`: binding names the generate path's fields).
Restarted workers pin the pinned adapters again (`pin_again`); a restarted core starts with none, as it starts
with no id bound, and its host pins them again and adds its other ids again (`EnginePins.pin_again`,
asyncllm/engine/engine_pins.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from asyncllm import errors, protocol
from asyncllm.engine.core_weights import answer_between_steps
from asyncllm.engine.lora_ids import pin_refusal
from asyncllm.lora import LoRARequest

if TYPE_CHECKING:
    from asyncllm.engine.core import EngineCore

__all__ = ["pin_lora", "unpin_removed", "pin_again"]

logger = logging.getLogger("asyncllm.engine.core")


def pin_lora(core: "EngineCore", client_id: bytes, message: protocol.PinLoRA) -> None:
    """Bind and pin the host's adapter, then answer the host (after every host got the new stats); ``unpin``: the
    host's `pin_lora` was refused by another replica, so none keeps it pinned (the id stays bound)."""
    if message.unpin:
        core.lora_ids.unpin(client_id, message.lora.lora_int_id)
        unpin_removed(core)
        core.io.send(client_id, protocol.LoRAPinned(message.call_id))
        return
    try:
        lora = core.lora_ids.bind(client_id, message.lora, core.config.enable_lora)
        core.lora_ids.check_pin(lora, core.running_lora_ids())
    except errors.InvalidRequestError as exc:
        refusal = pin_refusal(exc, message.lora.lora_int_id)
        core.io.send(client_id, protocol.LoRAPinned(message.call_id, **protocol.call_error_fields(refusal)))
        return
    answer_between_steps(core, client_id, lambda: _pin_on_workers(core, message.call_id, lora))


def _pin_on_workers(core: "EngineCore", call_id: str, lora: LoRARequest) -> protocol.LoRAPinned:
    """Every rank reads and pins `lora` (its core id); pinned in the core only if all did."""
    if lora.lora_int_id in core.lora_ids.pinned:
        return protocol.LoRAPinned(call_id)
    try:
        replies = core.executor.pin_lora(protocol.PinLoRA(call_id, lora))
    except errors.EngineDeadError as exc:
        core.recover_workers(exc)  # bounded by max_worker_restarts; the new workers pin the pinned ones again
        return protocol.LoRAPinned(call_id, **protocol.call_error_fields(errors.EngineDeadError(
            f"the workers failed ({exc}); they were restarted, without this adapter pinned")))
    refused = next((reply for reply in replies if reply.error_type), None)
    if refused is not None:  # a rank could not read it: none keeps it pinned
        _unpin_on_workers(core, [lora])
        return msgspec.structs.replace(refused, rank=0)
    core.lora_ids.pinned[lora.lora_int_id] = lora
    logger.info("LoRA adapter %r pinned (core id %d): %d of max_loras=%d slots pinned", lora.lora_name,
                lora.lora_int_id, len(core.lora_ids.pinned), core.lora_ids.slots)
    return protocol.LoRAPinned(call_id)


def unpin_removed(core: "EngineCore") -> None:
    """The workers unpin the adapters whose pinned id was removed or whose host detached (between steps)."""
    unpinned = core.lora_ids.take_unpinned()
    if not unpinned:
        return
    if core.overlap is not None and core.overlap.in_flight:
        core.overlap.drain([])
    _unpin_on_workers(core, unpinned)


def _unpin_on_workers(core: "EngineCore", adapters: list[LoRARequest]) -> None:
    for lora in adapters:
        try:
            core.executor.pin_lora(protocol.PinLoRA("unpin", lora, unpin=True))
        except errors.EngineDeadError as exc:
            core.recover_workers(exc)  # the new workers pin only what is still pinned
            return


def pin_again(core: "EngineCore") -> None:
    """Restarted workers: pin the pinned adapters again (read from their folders). One that cannot be read any
    more is unpinned (logged): the engine serves on without it."""
    for lora in list(core.lora_ids.pinned.values()):
        replies = core.executor.pin_lora(protocol.PinLoRA("restart", lora))  # EngineDeadError: the caller's
        refused = next((reply for reply in replies if reply.error_type), None)
        if refused is not None:
            logger.error("restarted workers could not pin LoRA adapter %r again (%s): it is unpinned",
                         lora.lora_name, refused.error)
            del core.lora_ids.pinned[lora.lora_int_id]
            _unpin_on_workers(core, [lora])
