"""POSIX shared-memory segments that Python's resource_tracker never hears of, and what the rings laid out in them share.

Before Python 3.13 both creating and attaching a `multiprocessing.shared_memory.SharedMemory` register the segment
with the resource tracker: creating starts a tracker process that outlives the engine in the host, and a reader's
tracker unlinks (and warns about) a segment it merely attached when that reader exits. The rings
(workers/shm_broadcast.py, asyncllm/mm/shm_ring.py) and the tensors of `update_weights_from_tensors`
(asyncllm/engine/weight_tensors.py) map ``/dev/shm`` files themselves instead: only the creator owns a segment, and
no process starts a tracker for one.

Both rings lay their words out on ``ALIGN``-byte (cache line) boundaries and order their stores and loads with
`fence` (x86-TSO keeps stores in order and loads in order; a Dekker-style handshake also needs the full barrier).
"""

from __future__ import annotations

import mmap
import os
import threading

__all__ = ["ALIGN", "MappedSegment", "OwnedSegment", "align_up", "attach_untracked", "fence"]

ALIGN = 64
"""The boundary (a cache line) the rings' headers and entries start on."""
_FENCE = threading.Lock()


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def fence() -> None:
    """A full memory barrier: acquiring a lock executes a locked instruction."""
    with _FENCE:
        pass


class MappedSegment:
    """``/dev/shm/NAME`` mapped, with SharedMemory's interface: name, size, buf, close."""

    def __init__(self, name: str, flags: int = os.O_RDWR, size: int | None = None) -> None:
        fd = os.open(os.path.join("/dev/shm", name), flags, 0o600)
        try:
            if size is None:
                size = os.fstat(fd).st_size
            else:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name, self.size = name, size
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap; `BufferError` (and still mapped) while a view of ``buf`` is alive."""
        self.buf.release()
        self._mmap.close()


class OwnedSegment(MappedSegment):
    """A new segment (mode 0600, zero-filled) that this process owns: it alone unlinks it."""

    def __init__(self, name: str, size: int) -> None:
        super().__init__(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, size)
        self._unlinked = False

    def unlink(self) -> None:
        """Remove the segment's name (mappings stay valid until each process unmaps); idempotent."""
        if not self._unlinked:
            self._unlinked = True
            os.unlink(os.path.join("/dev/shm", self.name))


def attach_untracked(name: str) -> MappedSegment:
    """Map a segment another process owns (`OSError` if it is gone, `ValueError` if it is empty)."""
    return MappedSegment(name)
