"""Driving an ``asyncllm serve`` subprocess: its address from its start line, and waiting until it answers."""

from __future__ import annotations

import subprocess
import time

import httpx

__all__ = ["line_with", "wait_healthy"]


def line_with(proc: subprocess.Popen, text: str) -> str:
    """The first stderr line of `proc` that has `text` (the lines before it are read and dropped)."""
    for line in proc.stderr:
        if text in line:
            return line
    raise AssertionError(f"no line with {text!r}; exit code {proc.wait()}")


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 180) -> None:
    """Until ``base/health`` answers 200; the server's stderr if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(base + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "asyncllm serve did not come up"
        time.sleep(0.2)
