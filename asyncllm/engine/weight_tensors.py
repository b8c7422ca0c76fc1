"""The host's half of `AsyncEngine.update_weights_from_tensors` (docs/weight-updates.md): the tensors in shared memory.

The host copies the caller's tensors (CPU or GPU, any layout) once, into one new POSIX shared-memory segment, each
contiguous at a 64-byte-aligned offset; the `UpdateWeights` message carries the segment's name and each tensor's
name, dtype, shape and offset (`protocol.WeightTensor`). Every worker rank maps the segment, checks the names and
shapes against its model, and copies its shard of each tensor into the parameters in place
(workers/weight_update.py). The host unlinks the segment when the call is answered, refused or failed, and when
the caller is cancelled (`pack_off_loop`).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import anyio
import torch

from asyncllm import protocol
from asyncllm.errors import InvalidRequestError
from asyncllm.shm_segment import ALIGN, OwnedSegment, align_up

__all__ = ["FIELD", "PackedTensors", "WEIGHT_DTYPES", "pack_off_loop", "pack_tensors", "segment_name", "tensor_views"]

FIELD = "named_tensors"
WEIGHT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}
"""The dtypes a pushed weight may have (each is cast to the parameter's dtype as it is copied)."""


class PackedTensors:
    """The segment and its tensors' places; `close` unmaps and unlinks it (call once the update is answered)."""

    def __init__(self, segment: OwnedSegment, tensors: list[protocol.WeightTensor]) -> None:
        self.segment, self.tensors = segment, tensors

    def close(self) -> None:
        self.segment.unlink()
        try:
            self.segment.close()
        except BufferError:  # a view still alive (an exception's traceback holds it): unmapped when it is freed
            pass


def pack_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> PackedTensors:
    """Check the caller's (name, tensor) pairs and copy them into a new segment (blocking: call off the loop);
    `InvalidRequestError` naming ``named_tensors`` for anything that is not a list of distinct names with
    floating-point tensors."""
    pairs = _checked_pairs(named_tensors)
    tensors, size = [], 0
    for name, tensor in pairs:
        tensors.append(protocol.WeightTensor(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), size))
        size += align_up(tensor.numel() * tensor.element_size())
    segment = OwnedSegment(segment_name(), max(size, ALIGN))
    try:
        for view, (_, tensor) in zip(tensor_views(segment.buf, tensors), pairs):
            view.copy_(tensor.detach())
            del view  # no export of the segment's buffer outlives the copy (close() needs none left)
    except BaseException:
        PackedTensors(segment, tensors).close()
        raise
    return PackedTensors(segment, tensors)


def segment_name() -> str:
    """A new segment's name, ``asyncllm-<pid>-w-<hex>``: a host killed before it unlinked one (SIGKILL, the OOM
    killer, mid-push) leaves it to the next process's sweep (`shm_segment.DEAD_OWNER`)."""
    return f"asyncllm-{os.getpid()}-w-{secrets.token_hex(8)}"


async def pack_off_loop(
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> PackedTensors:
    """`pack_tensors` in a worker thread. A caller cancelled while it copies (a timeout) does not wait for the
    copy: whichever of the thread and the caller comes second closes the segment, so none is left in /dev/shm."""
    lock = threading.Lock()
    state: dict[str, Any] = {"abandoned": False, "packed": None}

    def pack() -> None:
        packed = pack_tensors(named_tensors)
        with lock:
            if not state["abandoned"]:
                state["packed"] = packed
                return
        packed.close()

    try:
        await anyio.to_thread.run_sync(pack, abandon_on_cancel=True)  # an anyio scope's deadline too returns at once
    except BaseException:
        with lock:
            state["abandoned"] = True
            packed = state["packed"]
        if packed is not None:
            packed.close()
        raise
    return state["packed"]


def tensor_views(buf: Any, tensors: list[protocol.WeightTensor]) -> Iterable[torch.Tensor]:
    """Each tensor as a view of the segment's bytes (a writable buffer), one at a time: the caller drops each view
    before the segment is closed. Empty tensors are fresh ones (a zero-length view of a buffer is refused)."""
    for spec in tensors:
        dtype = WEIGHT_DTYPES[spec.dtype]
        numel = 1
        for dim in spec.shape:
            numel *= dim
        if numel == 0:
            yield torch.empty(spec.shape, dtype=dtype)
            continue
        yield torch.frombuffer(buf, dtype=torch.uint8, count=numel * dtype.itemsize,
                               offset=spec.offset).view(dtype).view(spec.shape)  # held by no local here


def _checked_pairs(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, Mapping):
        named_tensors = list(named_tensors.items())
    if isinstance(named_tensors, (str, bytes)) or not isinstance(named_tensors, Iterable):
        raise InvalidRequestError(FIELD, "(name, torch.Tensor) pairs or a {name: tensor} mapping (e.g. a "
                                         f"state_dict()), got {type(named_tensors).__name__}")
    pairs, seen = [], set()
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise InvalidRequestError(FIELD, f"(name, torch.Tensor) pairs, got {_describe(item)}")
        name, tensor = item
        if name in seen:
            raise InvalidRequestError(FIELD, f"each name once, got {name!r} twice")
        if str(tensor.dtype).removeprefix("torch.") not in WEIGHT_DTYPES:
            raise InvalidRequestError(FIELD, f"floating-point tensors ({', '.join(WEIGHT_DTYPES)}), got {name!r} "
                                             f"of {tensor.dtype}")
        seen.add(name)
        pairs.append((name, tensor))
    if not pairs:
        raise InvalidRequestError(FIELD, "at least one (name, tensor) pair, got none")
    return pairs


def _describe(item: Any) -> str:
    if isinstance(item, tuple):
        return "(" + ", ".join(type(part).__name__ for part in item) + ")"
    return type(item).__name__
