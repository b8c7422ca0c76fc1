"""The host's half of the processor cache: what it knows the core can find, per cache type.

`LruHostCache` mirrors the core's lru store (keys and sizes; asyncllm/mm/cache.py).
`ShmHostCache` writes processed items into the host's shared-memory ring and
keeps its index (asyncllm/mm/shm_ring.py). Both answer the processor's two
questions: is this key cached (an item without data), and here is a processed
item (record it; the item to send).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from asyncllm.mm.cache import MirrorEntry, ProcessorCacheMirror
from asyncllm.mm.shm_ring import ShmRingWriter
from asyncllm.protocol import MultiModalItem

__all__ = ["HostProcessorCache", "LruHostCache", "ShmHostCache", "inline_item"]

logger = logging.getLogger("asyncllm.mm")


def inline_item(key: str, offset: int, length: int, pixel_values: np.ndarray) -> MultiModalItem:
    """An item carrying its data in the message."""
    return MultiModalItem(key, offset, length, pixel_values.tobytes(), list(pixel_values.shape), str(pixel_values.dtype))


class LruHostCache:
    """Keys and sizes of what the core's lru store holds (the same LRU over the same budget)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.mirror = ProcessorCacheMirror(capacity_bytes)

    def lookup(self, key: str, offset: int) -> MultiModalItem | None:
        entry = self.mirror.get(key)
        return None if entry is None else MultiModalItem(key, offset, entry.length, shape=list(entry.shape))

    def record(self, key: str, offset: int, length: int, pixel_values: np.ndarray) -> MultiModalItem:
        self.mirror.put(key, pixel_values.nbytes, MirrorEntry(length, tuple(pixel_values.shape)))  # as the core
        return inline_item(key, offset, length, pixel_values)

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self.mirror.drop(key)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class RingMeta:
    """What the host keeps beside a ring entry to send it as a location only."""

    length: int
    shape: list[int]
    dtype: str


class ShmHostCache:
    """The host's shm ring (created per connection to a core) and its index."""

    def __init__(self, capacity_bytes: int) -> None:
        self.ring: ShmRingWriter[RingMeta] = ShmRingWriter(capacity_bytes)

    @property
    def name(self) -> str:
        return self.ring.name

    def lookup(self, key: str, offset: int) -> MultiModalItem | None:
        entry = self.ring.get(key)
        if entry is None:
            return None
        meta = entry.meta
        return MultiModalItem(key, offset, meta.length, None, meta.shape, meta.dtype, entry.offset, entry.generation)

    def record(self, key: str, offset: int, length: int, pixel_values: np.ndarray) -> MultiModalItem:
        """Write the item into the ring and send its location (inline data when it is larger than the ring)."""
        meta = RingMeta(length, list(pixel_values.shape), str(pixel_values.dtype))
        entry = self.ring.put(key, memoryview(np.ascontiguousarray(pixel_values)), meta)
        if entry is None:
            return inline_item(key, offset, length, pixel_values)
        return MultiModalItem(key, offset, length, None, meta.shape, meta.dtype, entry.offset, entry.generation)

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self.ring.drop(key)

    def close(self) -> None:
        self.ring.close()


HostProcessorCache = LruHostCache | ShmHostCache
