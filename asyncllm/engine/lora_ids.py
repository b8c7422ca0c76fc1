"""Each host's LoRA adapter ids are its own: hosts sharing a core may number their adapters alike.

The core runs a host's ``lora_int_id`` under a core id of its own (`HostLoRAIds`): the scheduler, the prefix
cache's keys and the workers' slots and CPU cache see core ids only, so two hosts' adapter 1 are two adapters, and
KV computed with one adapter never serves another. A host's ids are forgotten when it detaches (`forget_host`, from
the core's client removal: a Goodbye or a host found dead). Core ids are never reused, so a host attached later (an
API server redeployed, numbering its adapters from 1 again) gets new ones and the workers read its adapters from
disk again: an adapter retrained in place is served fresh, while the old one's weights may stay cached under the
old id until evicted.

`AsyncEngine.add_lora` reaches the core (`AddLoRA`, answered by `LoRAAdded`): the host's id is bound there at once,
and a folder the core's machine cannot read, or an id the host already gave another folder, is an
`InvalidRequestError` from the core. `AsyncEngine.remove_lora` (`RemoveLoRA`, answered by `LoRARemoved`) forgets one
host id (vLLM's ``remove_lora``): its requests still running keep the core id they run under; the id used again is
bound afresh, under a new core id (the workers read its folder again). The workers' slots and CPU cache are not told:
they keep a removed adapter's weights until evicted, as any adapter's (least recently used first).

Bounded: past `kept_lora_ids` (the workers' CPU cache's size, at least 64) of a host's ids, the least recently used
ones no request in the core runs with are forgotten, as a removed id (`IdleIds`). The host forgets its own
likewise (`AdapterChecker.forget_idle`) and tells the core (a `RemoveLoRA` nobody waits on), so an id it checks
afresh is never refused here for the folder it named before.

Pinned (`AsyncEngine.pin_lora`, `PinLoRA`; asyncllm/engine/core_lora.py runs it on the workers): a pinned id is
never forgotten as idle, and its adapter holds one of the ``max_loras`` slots for good (the scheduler counts it:
`Scheduler.pinned_loras`). At most ``max_loras`` adapters are pinned; the last slot is pinned only while no request
in the core runs another adapter, and with every slot pinned a request of any other adapter is refused. Removing the
id (or its host detaching) unpins it (`take_unpinned`: the workers are told).
"""

from __future__ import annotations

import os
from typing import Callable, Collection

import msgspec

from asyncllm import protocol
from asyncllm.engine.sleep import PendingSleepCalls
from asyncllm.errors import InvalidRequestError
from asyncllm.lora import KEPT_LORA_IDS, IdleIds, LoRARequest, read_adapter

__all__ = ["HostLoRAIds", "PendingLoRACalls", "pin_refusal"]


class HostLoRAIds:
    """(host, its ``lora_int_id``) -> the core's adapter id and the adapter's folder (its realpath: two paths to one
    folder, a symlink, are one adapter, as for the host's `AdapterChecker`)."""

    def __init__(self, kept: int = KEPT_LORA_IDS, in_use: Callable[[], Collection[int]] = frozenset,
                 slots: int = 0) -> None:
        self._ids: dict[bytes, dict[int, tuple[int, str]]] = {}
        """Host -> its ids -> (core id, folder), least recently used first."""
        self._next_id = 1
        self._kept = kept
        """Each host's ids no request runs with that stay bound (`kept_lora_ids`)."""
        self._idle: dict[bytes, IdleIds] = {}
        """Host -> when to forget which of its idle ids."""
        self._in_use = in_use
        """The core ids of the requests in the core (queued, running, parked for a grammar): never forgotten."""
        self.slots = slots
        """The workers' adapter slots (``max_loras``): the most adapters pinned."""
        self.pinned: dict[int, LoRARequest] = {}
        """Core id -> its adapter (under the core id), pinned on the workers: never forgotten, never evicted."""
        self._unpinned: list[LoRARequest] = []
        """Pinned adapters whose id was removed or whose host detached: the workers are still to unpin them."""

    def core_lora(self, client_id: bytes, lora: LoRARequest | None, request: bool = True) -> LoRARequest | None:
        """`client_id`'s adapter under its core id (a new one for an id the host has not used), not yet recorded
        (`record`); `InvalidRequestError` when the host's id already names another folder: one id, one adapter, or
        (a `request`'s adapter) when every slot holds another, pinned adapter."""
        if lora is None:
            return None
        known = self._ids.get(client_id, {}).get(lora.lora_int_id)
        if known is None:
            if request:
                self._check_slot_free(self._next_id)
            return msgspec.structs.replace(lora, lora_int_id=self._next_id)
        core_id, path = known
        if path != os.path.realpath(lora.lora_path):
            raise InvalidRequestError("lora_request", f"lora_int_id {lora.lora_int_id} already names the adapter at "
                                                      f"{path}: one id, one adapter")
        if request:
            self._check_slot_free(core_id)
        return msgspec.structs.replace(lora, lora_int_id=core_id)

    def _check_slot_free(self, core_id: int) -> None:
        """`InvalidRequestError` when every adapter slot holds a pinned adapter other than `core_id`'s: its
        requests could never run (`pin_lora`)."""
        if self.slots and len(self.pinned) >= self.slots and core_id not in self.pinned:
            raise InvalidRequestError("lora_request", f"every one of the max_loras={self.slots} adapter slots holds "
                                                      "a pinned adapter (pin_lora): remove_lora one of them, or start "
                                                      "the engine with a larger max_loras")

    def record(self, client_id: bytes, host_id: int, core: LoRARequest | None) -> None:
        """Keep the core id of an accepted request's adapter (`core_lora` gave it), the most recently used now: a
        refused request pins no id. Past `kept` ids, the host's least recently used idle ones are forgotten."""
        if core is None:
            return
        ids = self._ids.setdefault(client_id, {})
        known = ids.pop(host_id, None)
        ids[host_id] = known or (core.lora_int_id, os.path.realpath(core.lora_path))
        self._next_id = max(self._next_id, core.lora_int_id + 1)
        idle = self._idle.get(client_id)
        if idle is None:
            idle = self._idle[client_id] = IdleIds(self._kept)
        for forgotten in idle.to_forget(ids, lambda: self._busy(ids)):
            del ids[forgotten]

    def _busy(self, ids: dict[int, tuple[int, str]]) -> set[int]:
        """The host ids among `ids` that a request in the core runs with."""
        in_use = set(self._in_use()) | self.pinned.keys()
        return {host_id for host_id, (core_id, _) in ids.items() if core_id in in_use}

    def add(self, client_id: bytes, message: protocol.AddLoRA, enabled: bool) -> protocol.LoRAAdded:
        """`AddLoRA`: bind the host's id to the folder if the core's machine reads an adapter there; the answer
        carries the refusal (an engine without LoRA, an id of another folder, no adapter at ``lora_path``)."""
        try:
            self.bind(client_id, message.lora, enabled)
        except InvalidRequestError as exc:
            return protocol.LoRAAdded(message.call_id, **protocol.call_error_fields(exc))
        return protocol.LoRAAdded(message.call_id)

    def bind(self, client_id: bytes, lora: LoRARequest, enabled: bool) -> LoRARequest:
        """Bind the host's id to ``lora``'s folder (`AddLoRA`, `PinLoRA`); the adapter under its core id.
        `InvalidRequestError`: an engine without LoRA, an id of another folder, no adapter at ``lora_path``."""
        if not enabled:
            raise InvalidRequestError("lora_request", "this engine serves no LoRA adapters: start it with "
                                                      "enable_lora=True")
        lora.validate()  # another peer's may be anything
        core = self.core_lora(client_id, lora, request=False)  # its requests are refused while every slot is pinned
        assert core is not None
        try:
            read_adapter(lora.lora_path)  # its config and tensor names and shapes, no weights
        except InvalidRequestError as exc:
            raise InvalidRequestError("lora_path", f"the engine core cannot use it: {exc.message}") from None
        except Exception as exc:  # noqa: BLE001 - a malformed folder fails the call, never the core
            raise InvalidRequestError("lora_path", f"the engine core cannot use it: {type(exc).__name__}: "
                                                   f"{exc}") from None
        self.record(client_id, lora.lora_int_id, core)
        return core

    def check_pin(self, core: LoRARequest, running: Collection[int]) -> None:
        """`InvalidRequestError` (naming ``lora_id``) when `core` may not be pinned now: every slot is pinned, or
        pinning the last one would leave requests in the core (`running`: their core ids) without a slot."""
        core_id = core.lora_int_id
        if core_id in self.pinned:
            return
        if len(self.pinned) >= self.slots:
            raise InvalidRequestError("lora_id", f"cannot pin more adapters than max_loras={self.slots} adapter "
                                                 f"slots: {len(self.pinned)} are pinned already (remove_lora one of "
                                                 "them first)")
        others = set(running) - self.pinned.keys() - {0, core_id}
        if len(self.pinned) + 1 == self.slots and others:
            raise InvalidRequestError("lora_id", f"pinning it would pin the last of the max_loras={self.slots} "
                                                 f"adapter slots while requests with {len(others)} other adapter(s) "
                                                 "are in the engine: pin it once they finish")

    def remove(self, client_id: bytes, message: protocol.RemoveLoRA) -> protocol.LoRARemoved:
        """`RemoveLoRA`: forget the host's id; the answer says whether it was bound (vLLM's False: unknown)."""
        removed = self._ids.get(client_id, {}).pop(message.lora_int_id, None)
        if removed is not None:
            self._unpin(removed[0])
        return protocol.LoRARemoved(message.call_id, removed is not None)

    def forget_host(self, client_id: bytes) -> None:
        """A host detached (Goodbye, or found dead): its ids name nothing any more (its pins end); a new host's
        same id and path get a new core id, so the workers read the adapter from disk again."""
        for core_id, _ in self._ids.pop(client_id, {}).values():
            self._unpin(core_id)
        self._idle.pop(client_id, None)

    def unpin(self, client_id: bytes, host_id: int) -> None:
        """A host's pinned id unpinned, still bound (`PinLoRA` ``unpin``: its `pin_lora` refused by another replica);
        nothing for an id not pinned."""
        known = self._ids.get(client_id, {}).get(host_id)
        if known is not None:
            self._unpin(known[0])

    def _unpin(self, core_id: int) -> None:
        pinned = self.pinned.pop(core_id, None)
        if pinned is not None:
            self._unpinned.append(pinned)

    def take_unpinned(self) -> list[LoRARequest]:
        """The adapters unpinned here since the last call, for the workers to unpin."""
        unpinned, self._unpinned = self._unpinned, []
        return unpinned

    def core_ids(self, client_id: bytes) -> dict[int, int]:
        """`client_id`'s host id -> core id (tests, debugging)."""
        return {host_id: core_id for host_id, (core_id, _) in self._ids.get(client_id, {}).items()}


class PendingLoRACalls(PendingSleepCalls):
    """The processor thread's `AddLoRA`, `RemoveLoRA` and `PinLoRA` sent and not answered yet; each future gets
    None (added), whether the id was removed, True (pinned), or the core's refusal."""

    @staticmethod
    def _result(reply: protocol.LoRAAdded | protocol.LoRARemoved | protocol.LoRAPinned  # type: ignore[override]
                ) -> bool | None:
        if isinstance(reply, protocol.LoRAPinned):
            return True
        return reply.removed if isinstance(reply, protocol.LoRARemoved) else None


def pin_refusal(exc: InvalidRequestError, lora_id: int) -> InvalidRequestError:
    """`exc` named as `pin_lora`'s only argument, ``lora_id``: `HostLoRAIds.bind` names the generate path's
    (``lora_request``; ``lora_path``: a folder the core cannot read, its message then says whose)."""
    if exc.field == "lora_id":
        return exc
    message = exc.message if exc.field != "lora_path" else f"the adapter of lora_int_id {lora_id}: {exc.message}"
    return InvalidRequestError("lora_id", message, code=exc.code)
