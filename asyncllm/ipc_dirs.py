"""Private folders for ``ipc://`` sockets (mode 0700: only this user can connect).

Their owner removes them (`remove_dir`: a host's at ``aclose()``, a core's once its workers connected); a folder
its owner did not remove goes when the process that made it exits normally (`_remove_held`, an ``atexit`` hook: a
host that exits without ``aclose()``). Never earlier: other hosts may attach to an owned core by its address
(``AsyncEngine.connect``) while its owner lives, and the owner's core ends with the owner. A forked child's exit
leaves its parent's folders (the parent may still serve with them); a killed process leaves its own.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from asyncllm import envs

__all__ = ["private_ipc_dir", "remove_dir"]

_held: dict[str, int] = {}
"""The folders `private_ipc_dir` made that `remove_dir` did not remove yet: path -> the pid of the process that made
it (a forked child inherits the dict, not the folders)."""


def private_ipc_dir() -> str:
    """A fresh 0700 folder for ipc:// sockets (remove it with `remove_dir`; left, it goes at this process's exit)."""
    parent = envs.RUNTIME_DIR.get() or None
    path = tempfile.mkdtemp(prefix="asyncllm-", dir=parent)
    os.chmod(path, 0o700)
    _held[path] = os.getpid()
    return path


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _held.pop(path, None)


@atexit.register
def _remove_held() -> None:
    """At interpreter exit: the folders this process made and still holds (its cores end with it: no host attached
    by their addresses needs them any more); those of a parent this process was forked from stay."""
    pid = os.getpid()
    for path, owner in list(_held.items()):
        if owner == pid:
            remove_dir(path)
