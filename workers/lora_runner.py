"""The model runner's LoRA hooks: which request runs which adapter, adapters into slots, the step's mask.

The model's projections hold ``max_loras`` adapter slots (asyncllm/models/lora.py).
Before a step, every adapter its requests use is put in a slot (the scheduler
never sends more than ``max_loras`` adapters in one step): a slot already
holding it is kept, otherwise the least recently used slot not needed by the
step is overwritten. Adapter weights read from disk stay in a CPU cache of
``max_cpu_loras`` adapters, so swapping one back into a slot reads no file.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from asyncllm.config import LoRAConfig
from asyncllm.lora import LoRARequest, read_adapter
from asyncllm.models.lora import LoRAContext, SlotBuffers, attach_lora_layers, load_adapter_tensors
from asyncllm.models.lora_experts import ExpertsLoRA
from asyncllm.models.pipeline import in_missing_part
from asyncllm.protocol import SchedulerOutput
from asyncllm.workers.request_fields import RequestField

__all__ = ["LoRARunner"]

logger = logging.getLogger("asyncllm.workers")

_Loaded = list[tuple[str, object, torch.Tensor, torch.Tensor, float]]


class LoRARunner:
    """Keeps each request's adapter and the slots' contents of one rank."""

    def __init__(self, model: Any, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
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

    def release_slots(self) -> None:
        """Sleep mode: the slots' memory goes with the weights'; every adapter is set again at its next step,
        from the CPU cache or its folder."""
        for layer in self.layers.values():
            layer.release()
        self.slots.clear()
        self.expert_slots.clear()
        self.context.set_step(None)  # the wake-up's graph capture runs without the last step's adapters

    def reallocate_slots(self) -> None:
        for layer in self.layers.values():
            layer.reallocate()

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
        errors = {}
        for adapter_id, adapter in needed.items():
            try:
                self._ensure_slot(adapter, needed)
            except Exception as exc:  # noqa: BLE001 - one unreadable adapter fails its requests, not the worker
                logger.error("LoRA adapter %r (id %d) at %s could not be loaded: %s", adapter.lora_name, adapter_id,
                             adapter.lora_path, exc)
                errors[adapter_id] = (f"lora_request: the workers could not load the adapter at {adapter.lora_path} "
                                      f"({type(exc).__name__}: {exc})")
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

    def _ensure_slot(self, adapter: LoRARequest, needed: dict[int, LoRARequest]) -> None:
        adapter_id = adapter.lora_int_id
        if adapter_id in self.slots:
            self.slots.move_to_end(adapter_id)
            return
        loaded = self._load(adapter)  # first: an adapter that cannot be read changes no slot
        used = set(self.slots.values())
        free = [slot for slot in range(self.num_slots) if slot not in used]
        if free:
            slot = free[0]
        else:
            victim = next(other for other in self.slots if other not in needed)
            slot = self.slots.pop(victim)
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

    def _load(self, adapter: LoRARequest) -> _Loaded:
        """The adapter's matrices, from the CPU cache or its folder."""
        cached = self.cpu_cache.get(adapter.lora_int_id)
        if cached is not None:
            self.cpu_cache.move_to_end(adapter.lora_int_id)
            return cached
        loaded = load_adapter_tensors(read_adapter(adapter.lora_path), self.model)
        self.cpu_cache[adapter.lora_int_id] = loaded
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
        return loaded
