"""POSIX shared-memory segments that Python's resource_tracker never hears of.

Before Python 3.13 both creating and attaching a `multiprocessing.shared_memory.SharedMemory` register the segment
with the resource tracker: creating starts a tracker process that outlives the engine in the host, and a reader's
tracker unlinks (and warns about) a segment it merely attached when that reader exits. The rings
(workers/shm_broadcast.py, asyncllm/mm/shm_ring.py) and the tensors of `update_weights_from_tensors`
(asyncllm/engine/weight_tensors.py) use these instead: only the creator owns a segment.
"""

from __future__ import annotations

import mmap
import os
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

__all__ = ["OwnedSegment", "attach_untracked"]


class OwnedSegment:
    """A new segment (``/dev/shm/NAME``, mode 0600) with SharedMemory's interface: name, size, buf, close,
    unlink."""

    def __init__(self, name: str, size: int) -> None:
        fd = os.open(os.path.join("/dev/shm", name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name, self.size = name, size
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:
        os.unlink(os.path.join("/dev/shm", self.name))


def attach_untracked(name: str) -> SharedMemory:
    """Attach to a segment another process owns, without the resource_tracker unlinking it when this one exits."""
    try:
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]  # Python >= 3.13
    except TypeError:
        shm = SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm
