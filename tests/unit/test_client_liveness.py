"""The core's watch over its hosts' processes (asyncllm/engine/client_liveness.py), on this machine's real /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from asyncllm.engine.client_liveness import ClientLiveness, _machine, _start_time, mark_heard, process_identity

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_killed_host_is_dead_even_unreaped_and_a_live_one_is_not() -> None:
    child = subprocess.Popen(["sleep", "30"])  # stands for a host process
    try:
        liveness = ClientLiveness(interval_s=0)
        liveness.watch(b"host", child.pid, f"{_machine()} {_start_time(child.pid)}")
        liveness.watch(b"me", os.getpid(), process_identity())
        assert list(liveness.dead_clients()) == []
        child.kill()
        deadline = time.monotonic() + 10  # the kill lands within moments; a zombie (not yet reaped) counts as dead
        while not liveness.dead_clients() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert list(liveness.dead_clients()) == [b"host"]
        child.wait()
        assert list(liveness.dead_clients()) == [b"host"]
        liveness.forget(b"host")
        assert list(liveness.dead_clients()) == []
    finally:
        child.kill()
        child.wait()


def test_a_reused_pid_another_machine_an_unreadable_proc_and_a_handshake_are_not_taken_for_the_host(
        monkeypatch) -> None:
    from asyncllm.engine import client_liveness

    liveness = ClientLiveness(interval_s=0)
    machine, _, start = process_identity().rpartition(" ")
    assert machine == _machine() and start == _start_time(os.getpid())
    liveness.watch(b"unreadable", os.getpid(), f"{machine} {int(start) + 1}")  # the core reads another start time
    liveness.watch(b"remote", 1 << 30, f"another-boot-id {machine.split()[1]} 1")  # another machine: not watched
    liveness.watch(b"handshake", 0, "")  # `connect.handshake` says pid 0 and no identity
    liveness.watch(b"reused", os.getpid(), process_identity())
    assert list(liveness.dead_clients()) == []  # (hidepid /proc, another time namespace: a live host never looks dead)
    monkeypatch.setattr(client_liveness, "_start_time", lambda pid: str(int(start) + 7))  # the pid now another's
    assert list(liveness.dead_clients()) == [b"reused"]


def test_checks_are_spaced_by_the_interval(monkeypatch) -> None:
    from asyncllm.engine import client_liveness

    liveness = ClientLiveness(interval_s=3600)
    liveness.watch(b"reused", os.getpid(), process_identity())
    monkeypatch.setattr(client_liveness, "_start_time", lambda pid: None)  # gone
    assert list(liveness.dead_clients()) == [b"reused"]
    assert list(liveness.dead_clients()) == []  # the next check is an hour away


def test_a_host_heard_as_the_core_forgets_it_stays_forgotten() -> None:
    """The I/O thread stamps `CoreIO.last_heard` while the busy loop may `forget` the host: a forget between its
    lookup and its stamp must not put the host back (a detached host's entry kept, and restamped, for good)."""
    liveness: ClientLiveness

    class ForgetOnLookup(dict):  # the busy loop forgets the host right after the I/O thread looked it up
        def __contains__(self, client_id: object) -> bool:
            found = super().__contains__(client_id)
            liveness.forget(client_id)  # type: ignore[arg-type]
            return found

        def get(self, client_id: object, default: object = None) -> object:
            found = super().get(client_id, default)
            liveness.forget(client_id)  # type: ignore[arg-type]
            return found

    last_heard = ForgetOnLookup()
    liveness = ClientLiveness(3.0, last_heard, interval_s=0)
    liveness.watch(b"host", 0, "", heartbeat_interval_s=1.0)
    assert list(last_heard) == [b"host"]
    mark_heard(last_heard, b"host")
    assert list(last_heard) == [] and liveness.dead_clients() == {}


def test_the_metrics_reporter_is_a_watched_host_first_and_never_an_anonymous_peer() -> None:
    """The engine-wide metrics go to a host whose death the core notices, else to one that named its process (in
    another pid namespace, say); a pid-0 Hello without heartbeats (a raw handshake) is never handed them."""
    liveness = ClientLiveness(3.0, interval_s=0)
    liveness.watch(b"anonymous", 0, "")
    liveness.watch(b"elsewhere", 1 << 30, "another-boot-id ns 1")  # named, not watched
    liveness.watch(b"watched", os.getpid(), process_identity())
    liveness.watch(b"beating", 0, "", heartbeat_interval_s=1.0)  # tcp://, timed out by the core
    assert liveness.reporter([b"anonymous", b"elsewhere", b"watched"]) == b"watched"
    assert liveness.reporter([b"anonymous", b"elsewhere", b"beating"]) == b"beating"
    assert liveness.reporter([b"anonymous", b"elsewhere"]) == b"elsewhere"
    assert liveness.reporter([b"anonymous"]) is None
    liveness.forget(b"elsewhere")
    assert liveness.reporter([b"anonymous", b"elsewhere"]) is None
