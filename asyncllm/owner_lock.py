"""Whether the process that made a file still holds it: an `flock` its owner keeps for its lifetime.

The socket folders (asyncllm/ipc_dirs.py) and shared-memory segments (asyncllm/shm_segment.py) a killed process
leaves are swept by the next process that makes one. A pid alone cannot tell that the maker died: in another pid
namespace (containers sharing ``/tmp`` or ``/dev/shm``) a live owner's pid reads as dead. The owner therefore holds a
shared `flock` on the file (a folder's ``owner.lock``, a segment itself) until it exits, however it exits (the
kernel drops the lock with the last descriptor: SIGKILL too; a forked child's copy keeps it); a sweeper removes only
what it can lock exclusively. A file made before its lock was taken, or by an older asyncllm, is left until it is
`ABANDONED_AFTER_S` old.
"""

from __future__ import annotations

import fcntl
import os
import time

__all__ = ["ABANDONED_AFTER_S", "hold", "is_held", "old_enough", "pid_alive"]

ABANDONED_AFTER_S = 60.0
"""A file without a holder is swept only once this old: its maker may be between creating it and locking it."""


def hold(fd: int) -> None:
    """Mark the open file ``fd`` as held by this process for as long as the descriptor (or a fork's copy) is open."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def is_held(path: str) -> bool | None:
    """Whether a live process holds ``path`` (`hold`); None when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:  # unreadable, a symlink: not ours to judge
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the probe's lock too
    return False


def old_enough(mtime: float) -> bool:
    return time.time() - mtime >= ABANDONED_AFTER_S


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs in this pid namespace (another user's too, and any pid that is not one: kept)."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: another user's process; no pid that large
        return True
    return True
