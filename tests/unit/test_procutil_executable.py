"""`procutil.child_executable`: the Python engine cores and workers start in (uWSGI from a venv: sys.executable is
the base interpreter, which lacks the venv's packages)."""

from __future__ import annotations

import multiprocessing
import sys
from multiprocessing import spawn

import pytest

from asyncllm import procutil


@pytest.fixture
def venv(tmp_path, monkeypatch):
    """A venv at tmp_path/venv with a bin/python, run by a base interpreter outside it (as uWSGI's is)."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path / "base"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "base" / "bin" / "python3.11"))
    monkeypatch.setattr(spawn, "_python_exe", sys.executable)  # as multiprocessing read it at import
    return python


def test_a_venv_runs_its_own_python_when_the_interpreter_lies_outside_it(venv) -> None:
    assert procutil.child_executable() == str(venv)


def test_the_interpreter_inside_the_venv_is_kept(venv, monkeypatch) -> None:
    monkeypatch.setattr(sys, "executable", str(venv.parent / "python3.11"))
    monkeypatch.setattr(spawn, "_python_exe", sys.executable)
    assert procutil.child_executable() == str(venv.parent / "python3.11")


def test_multiprocessing_set_executable_wins(venv, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(spawn, "_python_exe", spawn._python_exe)  # restored after the test
    multiprocessing.set_executable(str(tmp_path / "chosen" / "python"))
    assert procutil.child_executable() == str(tmp_path / "chosen" / "python")


def test_no_venv_runs_sys_executable(venv, monkeypatch) -> None:
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)
    assert procutil.child_executable() == sys.executable


def test_spawn_module_starts_the_child_executable(venv, monkeypatch) -> None:
    started = []
    monkeypatch.delenv("ASYNCLLM_FORKSERVER", raising=False)
    monkeypatch.setattr(procutil.subprocess, "Popen", lambda argv, **kwargs: started.append(argv))
    procutil.spawn_module("asyncllm.engine.core", ["--x"])
    assert started[0][0] == str(venv) and started[0][-3:] == ["-m", "asyncllm.engine.core", "--x"]
