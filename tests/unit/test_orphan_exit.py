"""A child whose parent died exits at once (asyncllm/procutil.py `exit_when_parent_dies`, ``os._exit``: no finally,
no atexit) after the calls `at_orphan_exit` registered: an engine core cut while its model loads unlinks its
broadcast ring's shared-memory segment, which Python's resource_tracker would otherwise report as leaked."""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD = """
import time
from multiprocessing.shared_memory import SharedMemory
from asyncllm.procutil import at_orphan_exit, exit_when_parent_dies
shm = SharedMemory(create=True, size=64)  # registered with the resource tracker, as the core's ring is
at_orphan_exit(shm.unlink)
exit_when_parent_dies()
print(shm.name, flush=True)
time.sleep(60)
"""


def test_a_child_whose_parent_is_gone_unlinks_its_segment_before_it_exits() -> None:
    child = subprocess.Popen([sys.executable, "-P", "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd="/tmp")
    name = child.stdout.readline().strip()
    # communicate closes the child's stdin: the parent's death, as the child sees it; stderr ends once the resource
    # tracker, which shares it, has ended too
    _, err = child.communicate(timeout=30)
    assert child.returncode == 0 and name and not os.path.exists(f"/dev/shm/{name}")
    assert "leaked" not in err, err
