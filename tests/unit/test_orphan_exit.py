"""A child whose parent died exits at once (asyncllm/procutil.py `exit_when_parent_dies`, ``os._exit``: no finally,
no atexit) after the calls `at_orphan_exit` registered: an engine core cut while its model loads unlinks its
broadcast ring's shared-memory segment, which Python's resource_tracker would otherwise report as leaked. While such
a call is registered the kernel's parent-death SIGKILL, which would skip it, is disarmed; once all are taken back it
is armed again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

_CHILD = """
import ctypes, time
from multiprocessing.shared_memory import SharedMemory
from asyncllm.procutil import at_orphan_exit, exit_when_parent_dies

def parent_death_signal():
    sig = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    return sig.value

exit_when_parent_dies()
forget = at_orphan_exit(print)
forget()
rearmed = parent_death_signal()
shm = SharedMemory(create=True, size=64)  # registered with the resource tracker, as the core's ring is
at_orphan_exit(shm.unlink)
print(shm.name, rearmed, parent_death_signal(), flush=True)
time.sleep(60)
"""

_PARENT = """
import sys, time
from asyncllm import procutil
procutil.spawn_module("orphan_child", [], {"PYTHONPATH": sys.argv[1], "ASYNCLLM_FORKSERVER": ""})
time.sleep(60)
"""


def test_a_child_whose_parent_is_killed_unlinks_its_segment_before_it_exits(tmp_path) -> None:
    (tmp_path / "orphan_child.py").write_text(textwrap.dedent(_CHILD))
    parent = subprocess.Popen([sys.executable, "-P", "-c", _PARENT, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd="/tmp")
    name, rearmed, while_registered = parent.stdout.readline().split()
    assert (rearmed, while_registered) == (str(int(signal.SIGKILL)), "0")
    parent.kill()  # the host dies while its core starts
    # stdout and stderr end once the child and its resource tracker, which share them, have ended too
    _, err = parent.communicate(timeout=30)
    assert not os.path.exists(f"/dev/shm/{name}")
    assert "leaked" not in err, err
