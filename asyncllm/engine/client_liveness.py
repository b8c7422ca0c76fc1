"""The core's watch over its hosts' processes: a host killed without a `Goodbye` (SIGKILL, the OOM killer) is noticed.

A host says goodbye when it closes; one that is killed cannot, and without this its requests would run to
max_tokens holding KV blocks, batch and LoRA slots, it would stay the engine-wide metrics reporter, and its shm
processor cache would stay mapped. `Hello` carries the host's pid and `process_identity()`: the machine's boot
id, the host's pid namespace and its start time (/proc/PID/stat), so the core checks only hosts that share its
machine and pid namespace (ipc://, or tcp:// from the same machine), and a pid reused by a new process does
not pass for the host. The core reads each watched host's /proc/PID/stat every `CHECK_INTERVAL_S` (a few
microseconds each; the busy loop pays one clock comparison in between).

A host attached over tcp:// sends a `Heartbeat` every `Hello.heartbeat_interval_s` (asyncllm/engine/channel.py):
one the core has heard nothing from for `host_heartbeat_timeout_s` (its machine died, the network is lost) is
silent, wherever it runs.

Not detected: a host over ipc:// in another pid namespace (a container), or off Linux (no /proc), or one whose
/proc entry the core cannot read as the host does (``hidepid``, systemd's ``ProtectProc=invisible``, another time
namespace): those are removed only by their `Goodbye` (docs/integrations/shared-engine.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from asyncllm.procutil import proc_stat

__all__ = ["CHECK_INTERVAL_S", "ClientLiveness", "HeardAt", "mark_heard", "process_identity"]

CHECK_INTERVAL_S = 0.5
"""How often the core checks that its watched hosts still run."""


def _machine() -> str:
    """This process's machine and pid namespace ("" off Linux): hosts with the same value share its pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot_id = file.read().strip()
        return f"{boot_id} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot, /proc/PID/stat field 22); None: no such process, or a
    zombie (killed, not yet reaped)."""
    fields = proc_stat(pid)
    if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def process_identity() -> str:
    """What a host's `Hello` says of its process: "<boot id> <pid namespace> <start time>"; "" off Linux."""
    machine = _machine()
    start = _start_time(os.getpid()) if machine else None
    return f"{machine} {start}" if start is not None else ""


class HeardAt:
    """When the core's I/O thread last received from one timed-out host (`time.monotonic`): a value of
    `CoreIO.last_heard`, which `ClientLiveness` alone adds and removes."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at


def mark_heard(last_heard: dict[bytes, HeardAt], client_id: bytes) -> None:
    """The I/O thread heard from `client_id`: restamp its entry, if the core times it out. It never adds one (a
    check then a set would re-add a host `ClientLiveness.forget` took out in between, for good)."""
    heard = last_heard.get(client_id)
    if heard is not None:  # one atomic lookup: a stamp on an entry taken out meanwhile is lost with it
        heard.at = time.monotonic()


class ClientLiveness:
    """Which of the hosts (by DEALER identity) the core watches have died or fell silent."""

    def __init__(self, silence_timeout_s: float | None = None, last_heard: dict[bytes, HeardAt] | None = None,
                 interval_s: float = CHECK_INTERVAL_S) -> None:
        self._machine = _machine()
        self._interval_s = interval_s
        self._watched: dict[bytes, tuple[int, str]] = {}
        """client_id -> (pid, start time) of each host on this machine and pid namespace."""
        self._next_check = 0.0
        self._silence_timeout_s = silence_timeout_s
        self._last_heard = last_heard if last_heard is not None else {}
        """client_id -> when the core's I/O thread last received from it (`CoreIO.last_heard`), for the hosts timed
        out (`watch` puts them in, `forget` takes them out; the I/O thread only restamps those: `mark_heard`)."""
        self._beating: set[bytes] = set()
        """The hosts that send heartbeats (tcp://)."""
        self._named: set[bytes] = set()
        """The hosts whose Hello named their process (a pid) or that send heartbeats: those that may export the
        engine-wide metrics (`reporter`)."""

    def watch(self, client_id: bytes, pid: int, identity: str, heartbeat_interval_s: float = 0.0) -> None:
        """A host said Hello: watch it if it runs beside the core and the core reads its start time as the host
        does (not under ``hidepid`` /proc or another time namespace, where a live host would look dead); time it
        out when it sends heartbeats and the core has a timeout; else it is left to its Goodbye."""
        if pid > 0 or heartbeat_interval_s > 0:
            self._named.add(client_id)
        else:
            self._named.discard(client_id)
        if heartbeat_interval_s > 0 and self._silence_timeout_s is not None:
            self._beating.add(client_id)
            self._last_heard[client_id] = HeardAt(time.monotonic())  # now: a busy core handles a Hello late
        machine, _, start = identity.rpartition(" ")
        if pid > 0 and self._machine and machine == self._machine and _start_time(pid) == start:
            self._watched[client_id] = (pid, start)
        else:
            self._watched.pop(client_id, None)

    def forget(self, client_id: bytes) -> None:
        self._watched.pop(client_id, None)
        self._beating.discard(client_id)
        self._last_heard.pop(client_id, None)
        self._named.discard(client_id)

    def reporter(self, clients: Iterable[bytes]) -> bytes | None:
        """Which of `clients` exports the engine-wide metrics: one whose death the core notices (watched, or timed
        out by its heartbeats) first, else one whose Hello named its process; None rather than an anonymous peer (pid
        0, no heartbeat), which only its own Goodbye would remove."""
        named = [client_id for client_id in clients if client_id in self._named]
        watched = (client_id for client_id in named if client_id in self._watched or client_id in self._beating)
        return next(watched, next(iter(named), None))

    def dead_clients(self) -> dict[bytes, str]:
        """The watched hosts whose process is gone, and the heartbeating ones silent too long, each with what
        happened (at most every `interval_s`; {} in between)."""
        if not self._watched and not self._beating:
            return {}
        now = time.monotonic()
        if now < self._next_check:
            return {}
        self._next_check = now + self._interval_s
        dead = {client_id: "died without a Goodbye (its process on this machine is gone)"
                for client_id, (pid, start) in self._watched.items() if _start_time(pid) != start}
        for client_id in self._beating:
            heard = self._last_heard.get(client_id)
            silent_s = 0.0 if heard is None else now - heard.at
            if silent_s > self._silence_timeout_s:  # type: ignore[operator] - set only with a timeout
                dead.setdefault(client_id, f"sent nothing, not even its heartbeat, for {silent_s:.0f} s "
                                           f"(host_heartbeat_timeout_s={self._silence_timeout_s})")
        return dead
