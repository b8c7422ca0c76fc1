"""The shared-memory ring of ``mm_processor_cache_type="shm"``: processed items, written once by the host.

One segment per host connection, ``mm_processor_cache_gb`` large. The host
(`ShmRingWriter`, on its processor thread) appends each processed item as an
entry, a 64-byte header then the data, wrapping to the start when the end is
reached; a new entry overwrites the oldest ones (FIFO, hits do not refresh).
Its index (key -> offset, generation, placeholder count, shape, dtype) never
leaves the host, so a repeated image crosses the socket as its key and
location only. The core (`ShmRingReader`) copies an entry out when the
request arrives, and trusts it only if the header still names the key and
generation the request carries, both before and after the copy::

    generation  uint64    unique per entry, 0 = being (over)written or dropped
    nbytes      uint64    data length
    key         16 bytes  blake2b of the item's key
    (padding to 64 bytes, then the data, padded to 64 bytes)

Before the host overwrites any byte of an entry it zeroes that entry's
generation (then its size and key digest, which data written over the
generation's bytes alone would otherwise complete), so a reader that finds the same generation after copying read
untouched data (the stores and loads are ordered on x86-TSO; the fences are
``asyncllm.shm_segment.fence``, a locked instruction, as in ``workers/shm_broadcast.py``). A mismatch is a
cache miss: the host resends the request with its data (docs/multimodal.md).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.shm_segment import ALIGN, MappedSegment, OwnedSegment, align_up, attach_untracked, fence

__all__ = ["HEADER_BYTES", "RingEntry", "ShmRingReader", "ShmRingWriter", "check_ring_room", "key_digest"]

HEADER_BYTES = ALIGN
"""An entry's header: one aligned line, so the data after it is aligned too."""
_KEY_BYTES = 16

M = TypeVar("M")


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=_KEY_BYTES).digest()


def _padded(nbytes: int) -> int:
    return HEADER_BYTES + align_up(nbytes)


@dataclass(frozen=True)
class RingEntry(Generic[M]):
    """Where an entry lies in the ring, and what the host keeps beside it (``meta``)."""

    offset: int
    nbytes: int
    generation: int
    meta: M

    @property
    def end(self) -> int:
        return self.offset + _padded(self.nbytes)


class _Header:
    """Typed views of the ring's words (generation and nbytes are aligned uint64)."""

    def __init__(self, shm: MappedSegment) -> None:
        self.words = np.ndarray((shm.size // 8,), dtype=np.uint64, buffer=shm.buf)
        self.buf = shm.buf

    def generation(self, offset: int) -> int:
        return int(self.words[offset // 8])

    def release(self) -> None:
        del self.words, self.buf


class ShmRingWriter(Generic[M]):
    """The host's half: creates and owns the segment, writes entries, keeps the index."""

    def __init__(self, capacity_bytes: int) -> None:
        capacity = capacity_bytes // ALIGN * ALIGN
        check_ring_room(capacity)
        self._shm = OwnedSegment(f"asyncllm-{os.getpid()}-mm-{secrets.token_hex(4)}", capacity)
        self.capacity = capacity
        self.name = self._shm.name
        self._view = _Header(self._shm)
        self._index: OrderedDict[str, RingEntry[M]] = OrderedDict()
        """Live entries, oldest first (which is also their order in the ring from `_head` on)."""
        self._head = 0
        self._next_generation = 1
        self._closed = False

    def get(self, key: str) -> RingEntry[M] | None:
        return self._index.get(key)

    def put(self, key: str, data: memoryview, meta: M) -> RingEntry[M] | None:
        """Write ``data`` as a new entry for ``key`` (None when it is larger than the whole ring)."""
        nbytes = data.nbytes
        raw = data.cast("B") if nbytes else b""  # memoryview cannot cast an empty (1, 0) view; before any change
        self.drop(key)
        if _padded(nbytes) > self.capacity:
            return None
        offset = self._reserve(_padded(nbytes))
        entry = RingEntry(offset, nbytes, self._next_generation, meta)
        self._next_generation += 1
        buf = self._view.buf
        self._view.words[offset // 8] = 0  # whatever bytes lay here, no reader may take them for a header yet
        fence()
        buf[offset + 8 : offset + 16] = nbytes.to_bytes(8, "little")
        buf[offset + 16 : offset + 16 + _KEY_BYTES] = key_digest(key)
        buf[offset + HEADER_BYTES : offset + HEADER_BYTES + nbytes] = raw
        fence()
        self._view.words[offset // 8] = entry.generation  # published: readers may use it from now on
        self._index[key] = entry
        return entry

    def drop(self, key: str) -> None:
        """Forget ``key`` and invalidate its entry (a reader holding its location now misses): its generation, then
        its size and key digest are zeroed, so that a later entry's data, which may overwrite the generation's bytes
        and leave the rest, never completes a header a stale location would accept."""
        entry = self._index.pop(key, None)
        if entry is not None:
            offset = entry.offset
            self._view.words[offset // 8] = 0
            fence()
            self._view.buf[offset + 8 : offset + 16 + _KEY_BYTES] = bytes(8 + _KEY_BYTES)

    def _reserve(self, size: int) -> int:
        """The offset of ``size`` free bytes at the head; the entries there are dropped first."""
        if self._head + size > self.capacity:
            self._drop_oldest_below(self.capacity)  # the tail left unused holds the oldest entries
            self._head = 0
        self._drop_oldest_below(self._head + size)
        fence()
        offset, self._head = self._head, self._head + size
        return offset

    def _drop_oldest_below(self, end: int) -> None:
        """Drop the oldest entries while they start in ``[head, end)`` (the ring is in FIFO order from the head)."""
        while self._index:
            key, entry = next(iter(self._index.items()))
            if not self._head <= entry.offset < end:
                return
            self.drop(key)

    def __len__(self) -> int:
        return len(self._index)

    def unlink(self) -> None:
        """Remove the segment's name (the core has mapped it, or never will); mappings stay valid."""
        self._shm.unlink()

    def close(self) -> None:
        """Unlink (if not yet) and unmap; idempotent."""
        self.unlink()
        if not self._closed:
            self._closed = True
            self._index = OrderedDict()
            self._view.release()
            self._shm.close()


def check_ring_room(capacity: int) -> None:
    """Refuse a ring larger than /dev/shm's free space: writing past it would kill the host with SIGBUS."""
    if capacity < HEADER_BYTES * 2:
        raise ConfigError("mm_processor_cache_gb", capacity / 2**30, "at least 128 bytes for the shm ring (or 0: off)")
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return
    free = stats.f_bavail * stats.f_frsize
    if capacity > free:
        raise ConfigError("mm_processor_cache_gb", round(capacity / 2**30, 3),
                          f"at most /dev/shm's free space ({free / 2**30:.2f} GiB) with mm_processor_cache_type='shm'; "
                          "lower it, enlarge /dev/shm (docker: --shm-size), or use 'lru'")


class ShmRingReader:
    """The core's view of one host's ring: copies entries out, verified against their header."""

    def __init__(self, name: str) -> None:
        self._shm = attach_untracked(name)
        self._view = _Header(self._shm)
        self.size = self._shm.size

    def read(self, key: str, offset: int, generation: int, nbytes: int, field: str) -> bytes | None:
        """The entry's data if it still holds ``key`` at ``generation``; None if it was overwritten."""
        if offset < 0 or offset % ALIGN or offset + HEADER_BYTES + nbytes > self.size or generation <= 0:
            raise InvalidRequestError(field, f"ring location (offset {offset}, {nbytes} bytes, generation "
                                      f"{generation}) is outside the host's ring of {self.size} bytes")
        view = self._view
        if view.generation(offset) != generation:
            return None
        fence()
        header = bytes(view.buf[offset + 8 : offset + 16 + _KEY_BYTES])
        data = bytes(view.buf[offset + HEADER_BYTES : offset + HEADER_BYTES + nbytes])
        fence()
        if view.generation(offset) != generation:
            return None  # overwritten while we copied
        if int.from_bytes(header[:8], "little") != nbytes or header[8:] != key_digest(key):
            return None
        return data

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None  # type: ignore[assignment]
            self._shm.close()
