"""The model runner's LoRA hooks: which request runs which adapter, adapters into slots, the step's mask.

The model's projections hold ``max_loras`` adapter slots (asyncllm/models/lora.py).
Before a step, every adapter its requests use is put in a slot (the scheduler
never sends more than ``max_loras`` adapters in one step): a slot already
holding it is kept, otherwise the least recently used slot not needed by the
step is overwritten. Adapter weights read from disk stay in a CPU cache of
``max_cpu_loras`` adapters, so swapping one back into a slot reads no file; the
cache is trimmed least recently used first, never a pinned adapter nor one the
step (or the pin) is placing.

A step's (or a pin's) folders are all read first, and with several ranks every
rank's read failures are settled before any slot changes (workers/rank_failures.py):
an adapter any rank could not read fails on every rank, each dropping what it read,
so no rank runs a request with its adapter while another runs it without. Every
rank reads exactly the adapters in neither a slot nor its CPU cache, which every
rank holds alike, so all of them meet in the same collective.

A pinned adapter (`pin_lora`, vLLM's: `PinLoRA` from the core) is read at once and
never leaves the CPU cache, nor its slot: the scheduler counts it against
``max_loras``. Only the requests running when it was pinned may need its slot for a
step (the core admitted them before); it then waits in the CPU cache and takes a
slot again at a later step, reading no file. Unpinned, it is the first to go.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from asyncllm import protocol
from asyncllm.config import LoRAConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.lora import LoRARequest, read_adapter
from asyncllm.models.lora import LoRAContext, SlotBuffers, attach_lora_layers, load_adapter_tensors
from asyncllm.models.lora_experts import ExpertsLoRA
from asyncllm.models.pipeline import in_missing_part
from asyncllm.protocol import SchedulerOutput
from asyncllm.workers.rank_failures import failure_detail, settle
from asyncllm.workers.request_fields import RequestField

__all__ = ["LoRARunner", "pin_lora"]

logger = logging.getLogger("asyncllm.workers")

_Loaded = list[tuple[str, object, torch.Tensor, torch.Tensor, float]]


class LoRARunner:
    """Keeps each request's adapter and the slots' contents of one rank."""

    def __init__(self, model: Any, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
                 group: Any = None) -> None:
        self.model = model
        self.group = group
        """Every rank's gloo group (`rank_failures.host_group`), on which reads are settled; None: one rank."""
        self.num_slots = config.max_loras
        self.max_cpu_loras = config.resolved_max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.context = LoRAContext()
        self.layers: dict[str, SlotBuffers] = attach_lora_layers(model, self.num_slots, config.max_lora_rank,
                                                               self.context)
        self.requests: RequestField = RequestField("lora")
        """Request id -> its `LoRARequest` (requests without one are not listed)."""
        self.slots: OrderedDict[int, int] = OrderedDict()
        """Adapter id -> the slot holding it, least recently used first."""
        self.cpu_cache: OrderedDict[int, _Loaded] = OrderedDict()
        """Adapter id -> its matrices on the CPU, least recently used first."""
        self.expert_slots: set[int] = set()
        """The slots whose adapter has matrices of the experts (a step running one takes the experts' LoRA path)."""
        self.pinned: dict[int, LoRARequest] = {}
        """Adapter id -> the pinned adapter (`pin`): never evicted from the CPU cache, nor from a slot but by a step
        of more adapters than the unpinned slots hold (the requests running when it was pinned)."""
        self.released = False
        """Sleep mode released the slots: a pinned adapter waits in the CPU cache until they are back."""

    def release_slots(self) -> None:
        """Sleep mode: the slots' memory goes with the weights'; every adapter is set again at its next step,
        from the CPU cache or its folder."""
        for layer in self.layers.values():
            layer.release()
        self.released = True
        self.slots.clear()
        self.expert_slots.clear()
        self.context.set_step(None)  # the wake-up's graph capture runs without the last step's adapters

    def reallocate_slots(self) -> None:
        for layer in self.layers.values():
            layer.reallocate()
        self.released = False

    def pin(self, adapter: LoRARequest) -> None:
        """Keep `adapter` in the CPU cache (read now if it is not there) and a slot until `unpin`; an
        `InvalidRequestError` when a rank could not read it, every rank pinning nothing."""
        adapter_id = adapter.lora_int_id
        fresh, failures = self._read_settled([] if adapter_id in self.cpu_cache else [adapter])
        if failures:
            raise InvalidRequestError("lora_id", _unreadable(adapter, failures[adapter_id]))
        self._load(adapter, fresh, {adapter_id: adapter})
        self.pinned[adapter_id] = adapter
        self._place_pinned({})

    def unpin(self, adapter_id: int) -> None:
        """`remove_lora` of a pinned id: evictable again, and the first to go from its slot and the CPU cache."""
        self.pinned.pop(adapter_id, None)
        for cache in (self.slots, self.cpu_cache):
            if adapter_id in cache:
                cache.move_to_end(adapter_id, last=False)
        self._trim_cpu_cache()

    def _place_pinned(self, needed: dict[int, LoRARequest]) -> None:
        """Each pinned adapter out of a slot (just pinned, after sleep mode, or pushed out by a step) takes a free
        slot, or an unpinned adapter's slot that the step (`needed`) does not use; from the CPU cache."""
        if self.released:
            return
        for adapter_id, adapter in self.pinned.items():
            if adapter_id not in self.slots and self._slot_for(needed, free_only=True) is not None:
                self._ensure_slot(adapter, needed, {})  # from the CPU cache, which keeps every pinned adapter

    def _slot_for(self, needed: dict[int, LoRARequest], free_only: bool = False) -> int | None:
        """The slot to fill (nothing changed): a free one, else the least recently used unpinned adapter's that the
        step (`needed`) does not use, else (not `free_only`: the requests running when an adapter was pinned) a
        pinned one's; None: none."""
        used = set(self.slots.values())
        free = next((slot for slot in range(self.num_slots) if slot not in used), None)
        if free is not None:
            return free
        unpinned = [other for other in self.slots if other not in needed and other not in self.pinned]
        victims = unpinned or ([] if free_only else [other for other in self.slots if other not in needed])
        return self.slots[victims[0]] if victims else None

    def update_states(self, sched_out: SchedulerOutput) -> None:
        self.requests.update_states(sched_out)

    def prepare(self, req_ids: list[str], num_scheduled_tokens: dict[str, int]) -> dict[str, str]:
        """Set the step's mask (None when no request of the step has an adapter).

        Returns the requests whose adapter could not be read (its folder gone or
        changed since the host checked it), with the error: they run without an
        adapter this step, and the core ends them with the error and drops their
        tokens; the other requests are not affected.
        """
        self.context.set_step(None)  # first: a step without adapters, or one that raises, keeps nothing older
        adapters = [self.requests.get(req_id) for req_id in req_ids] if self.requests else []
        if not any(adapters):
            return {}
        needed = {adapter.lora_int_id: adapter for adapter in adapters if adapter is not None}
        assert len(needed) <= self.num_slots, f"{len(needed)} adapters in one step, max_loras={self.num_slots}"
        fresh, failures = self._read_settled([adapter for adapter_id, adapter in needed.items()
                                              if adapter_id not in self.slots and adapter_id not in self.cpu_cache])
        errors = {adapter_id: f"lora_request: {_unreadable(needed[adapter_id], detail)}"
                  for adapter_id, detail in failures.items()}
        for adapter_id, adapter in needed.items():
            if adapter_id in errors:
                continue
            try:
                self._ensure_slot(adapter, needed, fresh)
            except Exception as exc:  # noqa: BLE001 - an adapter the model cannot take fails its requests only
                logger.error("LoRA adapter %r (id %d) at %s could not be set: %s", adapter.lora_name, adapter_id,
                             adapter.lora_path, exc)
                errors[adapter_id] = f"lora_request: {_unreadable(adapter, failure_detail(exc, None))}"
        self._place_pinned(needed)  # a pinned adapter a step pushed out takes a slot back once one frees
        failed = {req_id: errors[a.lora_int_id] for req_id, a in zip(req_ids, adapters)
                  if a is not None and a.lora_int_id in errors}
        for req_id in failed:
            del self.requests[req_id]
        token_slots = torch.tensor([-1 if a is None or a.lora_int_id in errors else self.slots[a.lora_int_id]
                                    for a in adapters])
        counts = torch.tensor([num_scheduled_tokens[req_id] for req_id in req_ids])
        token_slots = torch.repeat_interleave(token_slots, counts)
        mask = token_slots[:, None] == torch.arange(self.num_slots)[None, :]
        experts = any(self.slots[a.lora_int_id] in self.expert_slots for a in adapters
                      if a is not None and a.lora_int_id not in errors)
        self.context.set_step(mask.to(device=self.device, dtype=self.dtype) if bool(mask.any()) else None, experts)
        return failed

    def _read_settled(self, adapters: list[LoRARequest]) -> tuple[dict[int, _Loaded], dict[int, str]]:
        """Read `adapters`' folders: the matrices of those every rank read, and adapter id -> the lowest failing
        rank's error for the others. A collective when `adapters` is not empty (every rank passes the same ids)."""
        if not adapters:
            return {}, {}
        fresh: dict[int, _Loaded] = {}
        failures: dict[int, str] = {}
        for adapter in adapters:
            try:
                fresh[adapter.lora_int_id] = load_adapter_tensors(read_adapter(adapter.lora_path), self.model)
            except Exception as exc:  # noqa: BLE001 - one unreadable adapter fails its requests, not the worker
                logger.error("LoRA adapter %r (id %d) at %s could not be loaded: %s", adapter.lora_name,
                             adapter.lora_int_id, adapter.lora_path, exc)
                failures[adapter.lora_int_id] = failure_detail(exc, self.group)
        failures = settle(failures, self.group)
        return {adapter_id: loaded for adapter_id, loaded in fresh.items() if adapter_id not in failures}, failures

    def _ensure_slot(self, adapter: LoRARequest, needed: dict[int, LoRARequest], fresh: dict[int, _Loaded]) -> None:
        """Put `adapter` in a slot (kept if there), from the CPU cache or `fresh` (read and settled this step)."""
        adapter_id = adapter.lora_int_id
        if adapter_id in self.slots:
            self.slots.move_to_end(adapter_id)
            return
        loaded = self._load(adapter, fresh, needed)
        slot = self._slot_for(needed)
        assert slot is not None, "more adapters in one step than slots"
        for holder in [other for other, held in self.slots.items() if held == slot]:
            del self.slots[holder]
        for layer in self.layers.values():
            layer.clear(slot)
        self.expert_slots.discard(slot)
        for module_name, part, lora_a, lora_b, scaling in loaded:
            layer = self.layers.get(module_name)
            if layer is None:  # another pipeline stage's layer; any other name is a bug, never a silent skip
                if not in_missing_part(self.model, f"{module_name}.weight"):
                    raise ValueError(f"the adapter's {module_name} has no LoRA layer in {type(self.model).__name__}")
                continue
            layer.set(slot, part, lora_a, lora_b, scaling)
            if isinstance(layer, ExpertsLoRA):
                self.expert_slots.add(slot)
        self.slots[adapter_id] = slot

    def _load(self, adapter: LoRARequest, fresh: dict[int, _Loaded], keep: dict[int, LoRARequest]) -> _Loaded:
        """The adapter's matrices, from the CPU cache or `fresh` (then cached, the cache trimmed but for `keep`)."""
        cached = self.cpu_cache.get(adapter.lora_int_id)
        if cached is not None:
            self.cpu_cache.move_to_end(adapter.lora_int_id)
            return cached
        loaded = fresh[adapter.lora_int_id]  # read before any slot changed (`_read_settled`)
        self.cpu_cache[adapter.lora_int_id] = loaded
        self._trim_cpu_cache(keep)
        return loaded

    def _trim_cpu_cache(self, keep: dict[int, LoRARequest] | None = None) -> None:
        """Down to ``max_cpu_loras`` adapters, least recently used first, never a pinned one nor one of `keep`
        (the step's: read first, each must still be there when its slot is set)."""
        evictable = [adapter_id for adapter_id in self.cpu_cache
                     if adapter_id not in self.pinned and adapter_id not in (keep or {})]
        for adapter_id in evictable[:max(0, len(self.cpu_cache) - self.max_cpu_loras)]:
            del self.cpu_cache[adapter_id]


def pin_lora(runner: Any, command: protocol.PinLoRA, rank: int) -> protocol.LoRAPinned:
    """A `PinLoRA` on this rank: pin (or unpin) the adapter; the answer carries an adapter it cannot read."""
    lora_runner: LoRARunner | None = getattr(runner, "lora_runner", None)
    if lora_runner is None:
        error = InvalidRequestError("lora_id", "this engine serves no LoRA adapters: start it with enable_lora=True")
        return protocol.LoRAPinned(command.call_id, rank, **protocol.call_error_fields(error))
    adapter = command.lora
    if command.unpin:
        lora_runner.unpin(adapter.lora_int_id)
        return protocol.LoRAPinned(command.call_id, rank)
    try:
        lora_runner.pin(adapter)
    except Exception as exc:  # noqa: BLE001 - an adapter a rank cannot read (every rank's answer says which) or
        # the model cannot take fails the call, not the worker
        logger.error("LoRA adapter %r at %s could not be pinned: %s", adapter.lora_name, adapter.lora_path, exc)
        error = exc if isinstance(exc, InvalidRequestError) else \
            InvalidRequestError("lora_id", _unreadable(adapter, failure_detail(exc, None)))
        return protocol.LoRAPinned(command.call_id, rank, **protocol.call_error_fields(error))
    return protocol.LoRAPinned(command.call_id, rank)


def _unreadable(adapter: LoRARequest, detail: str) -> str:
    return f"the workers could not load the adapter at {adapter.lora_path} ({detail})"
