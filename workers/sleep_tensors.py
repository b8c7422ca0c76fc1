"""Every tensor a model holds, moved to CPU memory and back by storage (sleep mode's level 1, docs/sleep-mode.md).

A module holds tensors in three ways: parameters, buffers (a pre-quantized layer's repacked int4 weights, scales,
zero points, ``g_idx``; rotary tables), and plain attributes, alone or in a tuple, list or dict (DeepSeek's
absorbed expansions), or in a plain object it keeps (a layer's ``quant_method``). `held_tensors` finds them all.

`Offloaded` copies each **storage** once and points every tensor on it at the copy, at its own offset, sizes and
strides, through ``tensor.data`` (the Python object stays: whoever holds it sees the move). So two attributes
sharing a storage still share it after the wake-up, and a view of a parameter stays a view of it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["held_tensors", "Offloaded"]

_DEPTH = 3
"""How deep in an attribute's containers and plain objects tensors are looked for (a tuple in a quant_method: 2)."""


_NOT_HOLDERS = (types.FunctionType, types.MethodType, types.ModuleType, functools.partial)
"""Objects whose attributes are not a module's tensors (a loader's function, its partial)."""


def held_tensors(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """Each tensor object on ``device`` that a module of ``model`` holds, once (submodules are walked as modules; a
    module referenced by an attribute that is not a submodule is not, so a draft's reference to its target is
    left out)."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if name != "_modules":
                _collect(value, found, _DEPTH)
    return [tensor for tensor in found.values() if _on(tensor, device)]


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is on ``device`` (``cuda`` without an index: any GPU)."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _collect(value: Any, found: dict[int, torch.Tensor], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        found.setdefault(id(value), value)
        return
    if depth == 0 or isinstance(value, (nn.Module, type, str, bytes, int, float, bool)) or value is None:
        return
    if isinstance(value, dict):
        items: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif hasattr(value, "__dict__") and not isinstance(value, _NOT_HOLDERS):
        items = vars(value).values()  # a layer's quant_method, its tensor-parallel group
    else:
        return
    for item in items:
        _collect(item, found, depth - 1)


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class Offloaded:
    """Tensors whose storages were copied to CPU memory (pinned with ``pin``, for DMA copies back), by storage."""

    def __init__(self, tensors: Iterable[torch.Tensor], pin: bool = False) -> None:
        by_storage: dict[int, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_storage.setdefault(storage_key(tensor), []).append(tensor)
        self.groups: list[tuple[torch.UntypedStorage, list[torch.Tensor]]] = []
        """(the CPU copy, the tensors on it)."""
        for members in by_storage.values():
            copy = _copy_storage(members[0].untyped_storage(), torch.device("cpu"), pin)
            _point_at(members, copy)
            self.groups.append((copy, members))

    def restore(self, device: torch.device) -> None:
        """Each storage copied back to ``device`` (asynchronously from pinned memory: the caller synchronizes), its
        tensors pointed at it; a tensor pointed elsewhere meanwhile (a level-2 sleep emptied its parameter) stays
        where it is, and a storage none still points at is not copied."""
        for copy, members in self.held():
            _point_at(members, _copy_storage(copy, device, pin=False))
        self.groups = []

    def held(self) -> list[tuple[torch.UntypedStorage, list[torch.Tensor]]]:
        """The groups with the tensors still on their copy, the others dropped (their CPU memory freed)."""
        self.groups = [(copy, still) for copy, members in self.groups
                       if (still := [t for t in members if storage_key(t) == copy.data_ptr()])]
        return self.groups


def _copy_storage(storage: torch.UntypedStorage, device: torch.device, pin: bool) -> torch.UntypedStorage:
    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=device, pin_memory=pin)
    copy.copy_(source, non_blocking=device.type == "cuda")  # to the GPU from pinned memory; from it, waited for
    return copy.untyped_storage()


def _point_at(tensors: list[torch.Tensor], storage: torch.UntypedStorage) -> None:
    """Each tensor on ``storage``, at its own offset, sizes and strides (the object kept; an inference tensor, one
    made in a step such as DeepSeek's expansions, stays one: mixing the two kinds breaks its version counter)."""
    for tensor in tensors:
        with torch.inference_mode(tensor.is_inference()):
            moved = torch.empty(0, dtype=tensor.dtype, device=storage.device)
            moved.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
            tensor.data = moved
