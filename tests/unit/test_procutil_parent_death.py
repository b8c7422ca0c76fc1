"""The kernel's parent-death signal for new interpreters (`procutil.spawn_module`, `procutil.die_with_parent`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

from asyncllm import procutil

_CHILD = textwrap.dedent(
    """
    import ctypes, os
    from asyncllm import procutil

    os.environ["ASYNCLLM_PARENT_PID"] = str(os.getppid())
    procutil.die_with_parent()
    signal = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(signal))  # PR_GET_PDEATHSIG
    print(signal.value, "ASYNCLLM_PARENT_PID" in os.environ, flush=True)
    os.environ["ASYNCLLM_PARENT_PID"] = "1"  # not our parent: it died before the signal was armed
    procutil.die_with_parent()
    print("outlived its parent", flush=True)
    """
)


def test_children_are_started_by_one_thread_that_outlives_the_callers_threads(monkeypatch) -> None:
    started: list[tuple[threading.Thread, str]] = []

    def popen(args, stdin, env, close_fds):
        started.append((threading.current_thread(), env["ASYNCLLM_PARENT_PID"]))
        return object()

    monkeypatch.setattr(subprocess, "Popen", popen)
    callers = [threading.Thread(target=procutil.spawn_module, args=("json.tool", [], {"ASYNCLLM_FORKSERVER": ""}))
               for _ in range(2)]
    for caller in callers:
        caller.start()
        caller.join()
    (spawner,) = {thread for thread, _ in started}
    assert len(started) == 2 and spawner.name == "asyncllm-spawner" and spawner.is_alive()
    assert {pid for _, pid in started} == {str(os.getpid())}


def test_a_child_is_started_inline_at_finalization_and_from_the_spawner_thread(monkeypatch) -> None:
    """Then the spawner cannot run: daemon threads stop at interpreter finalization (a `__del__` that starts a
    child), and the spawner would wait for itself."""
    started: list[threading.Thread] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: started.append(threading.current_thread()))
    env = {"ASYNCLLM_FORKSERVER": ""}
    nested = threading.Thread(target=procutil._in_spawner_thread,
                              args=(lambda: procutil.spawn_module("json.tool", [], env),), daemon=True)
    nested.start()
    nested.join(timeout=5)
    assert not nested.is_alive() and [thread.name for thread in started] == ["asyncllm-spawner"]
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)
    procutil.spawn_module("json.tool", [], env)
    assert started[1] is threading.current_thread()


def test_a_child_arms_sigkill_and_exits_when_its_parent_is_not_the_one_that_started_it() -> None:
    env = {name: value for name, value in os.environ.items() if name != "ASYNCLLM_FORKSERVER"}
    child = subprocess.run([sys.executable, "-P", "-c", _CHILD], env=env, capture_output=True, text=True, timeout=30)
    assert (child.returncode, child.stdout) == (0, "9 False\n"), child.stderr
