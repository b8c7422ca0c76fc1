"""Shared-memory segments a killed process left (a core SIGKILLed before its workers mapped its broadcast ring, a
host's multimodal ring or the tensors it pushed) are unlinked by the next process that makes one
(asyncllm/shm_segment.py), never a segment a live process holds, even one whose pid reads as dead here (another pid
namespace), nor a young one."""

from __future__ import annotations

import fcntl
import os
import secrets
import signal
import subprocess
import sys
import time

import torch

from asyncllm import owner_lock, shm_segment
from asyncllm.engine import weight_tensors

CHILD = ("import os, secrets; from asyncllm.shm_segment import OwnedSegment\n"
         "s = OwnedSegment(f'asyncllm-{os.getpid()}-{secrets.token_hex(4)}', 4096); print(s.name, flush=True); input()")


def _age(path: str) -> None:
    old = time.time() - owner_lock.ABANDONED_AFTER_S - 1
    os.utime(path, (old, old))


def test_a_killed_owners_segment_is_unlinked_by_the_next_maker() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = child.stdout.readline().strip()
    path = os.path.join(shm_segment.SHM_DIR, name)
    try:
        _age(path)
        assert name not in shm_segment.sweep_dead_segments() and os.path.exists(path)  # its owner lives
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert os.path.exists(path)  # left behind: no resource tracker
        assert name in shm_segment.sweep_dead_segments() and not os.path.exists(path)
    finally:
        child.kill()
        child.wait(timeout=10)
        child.stdin.close()
        child.stdout.close()
        if os.path.exists(path):
            os.unlink(path)


def test_a_held_or_young_segment_of_a_dead_pid_is_kept() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    name = f"asyncllm-{dead.pid}-mm-{secrets.token_hex(4)}"
    path = os.path.join(shm_segment.SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        assert name not in shm_segment.sweep_dead_segments() and os.path.exists(path)  # young
        _age(path)
        fcntl.flock(fd, fcntl.LOCK_SH)  # a live owner in another pid namespace
        assert name not in shm_segment.sweep_dead_segments() and os.path.exists(path)
        os.close(fd)
        fd = -1
        assert name in shm_segment.sweep_dead_segments() and not os.path.exists(path)
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(path):
            os.unlink(path)


def test_the_weights_a_killed_host_pushed_are_swept() -> None:
    """A host SIGKILLed (the OOM killer: a push doubles its memory for the weights) before it unlinked the tensors of
    its `update_weights_from_tensors` leaves them in /dev/shm: their name says whose they were, so they are swept."""
    packed = weight_tensors.pack_tensors({"w": torch.ones(3)})
    packed.close()
    assert packed.segment.name.startswith(f"asyncllm-{os.getpid()}-w-")
    assert shm_segment.DEAD_OWNER.fullmatch(packed.segment.name)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    name = f"asyncllm-{dead.pid}-w-{secrets.token_hex(8)}"
    path = os.path.join(shm_segment.SHM_DIR, name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        _age(path)
        assert name in shm_segment.sweep_dead_segments() and not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_a_segment_that_fails_to_map_leaves_no_file() -> None:
    """An `OwnedSegment` whose mapping fails (an empty size, or one past the address space) removes the file it
    created: nothing of a live process is swept, so until 2026-12-08 it stayed in /dev/shm for the process's life."""
    for size in (0, 2**48):
        name = f"asyncllm-{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(shm_segment.SHM_DIR, name)
        try:
            try:
                shm_segment.OwnedSegment(name, size)
            except (OSError, ValueError):
                pass
            assert not os.path.exists(path), size
        finally:
            if os.path.exists(path):
                os.unlink(path)
    name = f"asyncllm-{os.getpid()}-{secrets.token_hex(4)}"  # a name taken: the other owner's file stays
    kept = shm_segment.OwnedSegment(name, 4096)
    try:
        try:
            shm_segment.OwnedSegment(name, 4096)
        except FileExistsError:
            pass
        assert os.path.exists(kept_path := os.path.join(shm_segment.SHM_DIR, name))
    finally:
        kept.unlink()
        kept.close()
    assert not os.path.exists(kept_path)
