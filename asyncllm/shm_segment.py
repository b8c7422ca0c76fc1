"""POSIX shared-memory segments that Python's resource_tracker never hears of, and what the rings in them share.

Before Python 3.13 both creating and attaching a `multiprocessing.shared_memory.SharedMemory` register the segment
with the resource tracker: creating starts a tracker process that outlives the engine in the host, and a reader's
tracker unlinks (and warns about) a segment it merely attached when that reader exits. The rings
(workers/shm_broadcast.py, asyncllm/mm/shm_ring.py) and the tensors of `update_weights_from_tensors`
(asyncllm/engine/weight_tensors.py) map ``/dev/shm`` files themselves instead: only the creator owns a segment, and
no process starts a tracker for one. What a killed creator leaves, the next process to create one sweeps
(`sweep_dead_segments`).

Both rings lay their words out on ``ALIGN``-byte (cache line) boundaries and order their stores and loads with
`fence` (x86-TSO keeps stores in order and loads in order; a Dekker-style handshake also needs the full barrier).
"""

from __future__ import annotations

import mmap
import os
import re
import threading

from asyncllm import owner_lock

__all__ = ["ALIGN", "MappedSegment", "OwnedSegment", "align_up", "attach_untracked", "fence", "sweep_dead_segments"]

SHM_DIR = "/dev/shm"
DEAD_OWNER = re.compile(r"asyncllm-(\d+)-(?:mm-|w-)?[0-9a-f]+")
"""The segments that name their maker's pid: the broadcast ring's (a core's), the multimodal ring's (a host's,
``-mm-``) and the tensors of `update_weights_from_tensors` (a host's, ``-w-``)."""
_swept = False
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

    def __init__(self, name: str, flags: int = os.O_RDWR, size: int | None = None, hold: bool = False) -> None:
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, flags, 0o600)
        try:
            if hold:
                owner_lock.hold(fd)
            if size is None:
                size = os.fstat(fd).st_size
            else:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if flags & os.O_CREAT and flags & os.O_EXCL:  # made here, never mapped: no sweep takes a live pid's file
                os.unlink(path)
            raise
        if not hold:
            os.close(fd)
        self._fd = fd if hold else -1
        self.name, self.size = name, size
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap (and let go of an owned segment); `BufferError` (and still mapped) while a view of ``buf`` is
        alive."""
        self.buf.release()
        self._mmap.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class OwnedSegment(MappedSegment):
    """A new segment (mode 0600, zero-filled) that this process owns: it alone unlinks it, and holds it
    (`owner_lock`) until it closes it or exits. The first one a process makes sweeps what killed processes left
    (`sweep_dead_segments`)."""

    def __init__(self, name: str, size: int) -> None:
        global _swept
        if not _swept:
            _swept = True
            sweep_dead_segments()
        super().__init__(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, size, hold=True)
        self._unlinked = False

    def unlink(self) -> None:
        """Remove the segment's name (mappings stay valid until each process unmaps); idempotent."""
        if not self._unlinked:
            self._unlinked = True
            os.unlink(os.path.join(SHM_DIR, self.name))


def sweep_dead_segments() -> list[str]:
    """Unlink the segments killed processes left (a core SIGKILLed before its workers mapped its ring, a host's
    multimodal ring or pushed weights): named ``asyncllm-<pid>-...`` (`DEAD_OWNER`), this user's, the pid dead, held
    by no process (`owner_lock`: a live owner in another pid namespace holds its own), a minute old. The names
    unlinked."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for name in names:
        match = DEAD_OWNER.fullmatch(name)
        path = os.path.join(SHM_DIR, name)
        if match is None or owner_lock.pid_alive(int(match[1])):
            continue
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid != os.getuid() or not owner_lock.old_enough(info.st_mtime):
            continue
        if owner_lock.is_held(path) is not False:
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:  # another sweep took it
            pass
    return removed


def attach_untracked(name: str) -> MappedSegment:
    """Map a segment another process owns (`OSError` if it is gone, `ValueError` if it is empty)."""
    return MappedSegment(name)
