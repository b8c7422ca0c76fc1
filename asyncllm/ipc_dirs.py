"""Private folders for ``ipc://`` sockets (mode 0700: only this user can connect).

Their owner removes them (`remove_dir`: a host's at ``aclose()``, a core's once its workers connected); a folder
its owner did not remove goes when the process that made it exits normally (`_remove_held`, an ``atexit`` hook: a
host that exits without ``aclose()``). Never earlier: other hosts may attach to an owned core by its address
(``AsyncEngine.connect``) while its owner lives, and the owner's core ends with the owner. A forked child's exit
leaves its parent's folders (the parent may still serve with them); a killed process (SIGKILL) leaves its own, which
the next host to make a folder in the same parent sweeps (`sweep_dead_dirs`): a folder is named
``asyncllm-<pid>-<4 hex digits>`` by the process that made it (short: a socket's path holds 107 bytes at most), and
goes once that pid is dead, no process holds the folder's ``owner.lock`` (asyncllm/owner_lock.py: the maker holds it
while it lives, so a live host in another pid namespace, whose pid reads as dead here, keeps its folder; a folder
without one goes once a minute old), the folder is this user's, and no socket in it takes connections (a core its
dead owner started, still serving the hosts attached to it while it ends). A reused pid reads as alive: its folder
waits for a later sweep.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile

from asyncllm import envs, owner_lock

__all__ = ["private_ipc_dir", "remove_dir", "sweep_dead_dirs"]

_NAME = re.compile(r"asyncllm-(\d+)-[0-9a-f]{4}")
"""A folder `private_ipc_dir` makes: the pid of the process that made it, then 4 random hex digits. Nothing else is
swept (``asyncllm engine``'s per-user ``asyncllm-<uid>`` folder, shared memory's ``asyncllm-<pid>-mm-*`` names,
older folders without a pid)."""

_swept: set[tuple[int, str]] = set()
"""The (pid, parent folder) pairs swept: once a process and parent."""

_LOCK = "owner.lock"
"""The file in each folder its maker holds (`owner_lock.hold`) while it lives."""

_locks: dict[str, int] = {}
"""The folders this process made -> the descriptor holding their ``owner.lock``."""

_held: dict[str, int] = {}
"""The folders `private_ipc_dir` made that `remove_dir` did not remove yet: path -> the pid of the process that made
it (a forked child inherits the dict, not the folders)."""


def private_ipc_dir() -> str:
    """A fresh 0700 folder for ipc:// sockets (remove it with `remove_dir`; left, it goes at this process's exit)."""
    parent = envs.RUNTIME_DIR.get() or tempfile.gettempdir()
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        from asyncllm.errors import ConfigError

        raise ConfigError("ASYNCLLM_RUNTIME_DIR", parent, "an existing folder this process can write (the engine's "
                                                          "ipc:// sockets go there)")
    if (os.getpid(), parent) not in _swept:
        _swept.add((os.getpid(), parent))
        sweep_dead_dirs(parent)
    for _ in range(10_000):  # as mkdtemp: a name taken (by a dead process of the same pid, or anyone) is passed over
        path = os.path.join(parent, f"asyncllm-{os.getpid()}-{secrets.token_hex(2)}")
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free asyncllm-{os.getpid()}-* name in {parent}")
    os.chmod(path, 0o700)
    lock = os.open(os.path.join(path, _LOCK), os.O_CREAT | os.O_RDWR, 0o600)
    owner_lock.hold(lock)
    _locks[path] = lock
    _held[path] = os.getpid()
    return path


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _held.pop(path, None)
    lock = _locks.pop(path, None)
    if lock is not None:
        os.close(lock)


def sweep_dead_dirs(parent: str) -> list[str]:
    """Remove the folders in `parent` that killed processes left (the module's docstring says which); the ones
    removed. Safe beside another host's sweep: a folder gone meanwhile is skipped, a removal half done by the other
    finished."""
    try:
        names = os.listdir(parent)
    except OSError:  # no such parent yet: nothing to sweep
        return []
    removed = []
    for name in names:
        match = _NAME.fullmatch(name)
        path = os.path.join(parent, name)
        if match is not None and _abandoned(path, int(match[1])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _abandoned(path: str, pid: int) -> bool:
    """A folder of this user's, made by a dead process that holds it no more, with no socket taking connections."""
    try:
        info = os.lstat(path)
    except OSError:  # gone: another sweep took it
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or owner_lock.pid_alive(pid):
        return False
    held = owner_lock.is_held(os.path.join(path, _LOCK))
    if held or (held is None and not owner_lock.old_enough(info.st_mtime)):
        return False
    return not _serving(path)


def _serving(path: str) -> bool:
    """Whether a socket in `path` takes connections (anything but a refusal, or a file gone, counts: kept)."""
    try:
        entries = [entry.path for entry in os.scandir(path) if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)]
    except OSError:
        return True
    for entry in entries:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(entry)
            except (ConnectionRefusedError, FileNotFoundError):  # a socket file its dead process left
                continue
            except OSError:
                return True
            return True
    return False


@atexit.register
def _remove_held() -> None:
    """At interpreter exit: the folders this process made and still holds (its cores end with it: no host attached
    by their addresses needs them any more); those of a parent this process was forked from stay."""
    pid = os.getpid()
    for path, owner in list(_held.items()):
        if owner == pid:
            remove_dir(path)
