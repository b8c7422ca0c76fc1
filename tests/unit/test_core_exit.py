"""How a dead engine core is reported: its exit code or signal, and a hard crash's Python stack on stderr."""

from __future__ import annotations

import subprocess
import sys

from asyncllm.engine.launch import CoreProcess

CRASH = "from asyncllm.procutil import report_crashes; report_crashes(); import ctypes; ctypes.string_at(0)"


def test_a_core_that_exits_or_crashes_is_reported_with_its_code_or_signal() -> None:
    exited = CoreProcess(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]), "ipc://x", "")
    death = exited.death(" while starting", wait_s=30.0)
    assert death is not None
    assert str(death).startswith(f"engine core (pid {exited.pid}) exited with code 3 while starting; ")
    assert "stderr" in str(death)

    crashed = CoreProcess(subprocess.Popen([sys.executable, "-c", CRASH], stderr=subprocess.PIPE), "ipc://x", "")
    _, stderr = crashed.proc.communicate(timeout=30.0)
    assert f"engine core (pid {crashed.pid}) was killed by SIGSEGV (a crash; faulthandler" in str(crashed.death())
    assert b"Fatal Python error: Segmentation fault" in stderr and b"<string>" in stderr  # the Python stack


def test_a_running_core_is_not_dead() -> None:
    running = CoreProcess(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]), "ipc://x", "")
    try:
        assert running.death() is None and running.death(wait_s=0.05) is None
    finally:
        running.proc.kill()
        running.proc.wait()
