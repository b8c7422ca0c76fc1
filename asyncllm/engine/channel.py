"""The host's end of the connection to the engine core: one DEALER that notices when the core is gone.

A host that owns its core also watches the core process (`CoreProcess.death`);
a host attached to a shared core (`AsyncEngine.connect`) has no process to
watch, so the connection itself must tell. A socket monitor reports the moment
the connection drops: the core process died (the kernel closes its end at
once), its machine went silent for `HEARTBEAT_TIMEOUT_MS`, or a CURVE
handshake failed (wrong key).

Only a tcp:// DEALER carries ZMTP heartbeats: on one machine (ipc://) the kernel
already reports a dead core at once, and a heartbeat could only misreport a live
one. libzmq's own threads answer them, so a long step is no silence, but a core
whose every thread waits for a starved CPU (or is stopped) is: a short timeout
there declared healthy cores dead on a loaded machine. vLLM likewise watches
the process, not a heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncllm import protocol
from asyncllm.auth import derive_keys, secure_client

__all__ = ["HEARTBEAT_IVL_MS", "HEARTBEAT_TIMEOUT_MS", "HOST_HEARTBEAT_IVL_S", "open_dealer", "unbounded",
           "ConnectionWatch", "HostHeartbeat"]

HEARTBEAT_IVL_MS = 1000
"""A ZMTP PING every this often (tcp:// only)."""
HEARTBEAT_TIMEOUT_MS = 10_000
"""No traffic from a tcp:// core for this long: the connection is dropped (and reported as lost). Long enough for
a core machine whose CPUs are starved for seconds; a dead core process is reported by its kernel, at once."""

HOST_HEARTBEAT_IVL_S = 1.0
"""A tcp:// host sends the core a `protocol.Heartbeat` this often: ZMTP's heartbeats are answered inside libzmq,
so the core cannot tell which host fell silent; this message names it (`host_heartbeat_timeout_s`)."""

_LOST_EVENTS = {
    zmq.EVENT_DISCONNECTED: "the connection to the engine core closed: the core process exited, or (tcp://) was silent for 10 s",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the engine core refused this host's key: ASYNCLLM_ENGINE_KEY differs",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the CURVE handshake with the engine core failed: "
                                          "ASYNCLLM_ENGINE_KEY differs from the core's",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the engine core speaks another security mechanism: "
                                         "a tcp:// core needs ASYNCLLM_ENGINE_KEY on both sides",
}


def unbounded(socket: zmq.Socket) -> zmq.Socket:
    """`socket` with no high-water mark either way (vLLM's engine-core sockets too; set before bind/connect). At
    zmq's default of 1000 messages a ROUTER silently drops what it sends a peer that stopped reading for a while (a
    paused or starved host, its processor thread in a long job), and a DEALER's or PUSH's send blocks: here a slow
    reader's messages wait in memory instead; a dead host is detached by the core's liveness checks, which stops
    its outputs, and a dead core by its host's watch."""
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


def open_dealer(ctx: zmq.Context, address: str, key: str | None, linger_ms: int = 0) -> zmq.Socket:
    """A DEALER connected to `address` (`unbounded`), with heartbeats when it is tcp://, and CURVE when `key` is
    given (tcp://)."""
    dealer = unbounded(ctx.socket(zmq.DEALER))
    dealer.setsockopt(zmq.LINGER, linger_ms)
    if address.startswith("tcp://"):
        dealer.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    if key is not None:
        secure_client(dealer, derive_keys(key))
    dealer.connect(address)
    return dealer


class ConnectionWatch:
    """Reports (`lost`) why the DEALER's connection to the core broke, if it did.

    Poll `socket` with the DEALER; close the watch before the DEALER.
    """

    def __init__(self, dealer: zmq.Socket) -> None:
        self._dealer = dealer
        events = 0
        for event in _LOST_EVENTS:
            events |= event
        self.socket: zmq.Socket = dealer.get_monitor_socket(events)

    def lost(self) -> str | None:
        """Why the connection broke since the last call (None: it did not); never blocks."""
        reason = None
        while self.socket.poll(0):
            event = recv_monitor_message(self.socket)["event"]
            reason = reason or _LOST_EVENTS.get(event)
        return reason

    def close(self) -> None:
        try:
            self._dealer.disable_monitor()
        except zmq.ZMQError:  # the DEALER is already closed
            pass
        self.socket.close(linger=0)


class HostHeartbeat:
    """The host's `protocol.Heartbeat`, sent every `interval_s` on a tcp:// connection (0: ipc://, none: the core
    watches a host on its machine by its pid), while `alive()` (a host the core detached, silent too long, was told
    so: it stops)."""

    def __init__(self, address: str, encoder: msgspec.msgpack.Encoder, alive: Callable[[], bool]) -> None:
        self.interval_s = HOST_HEARTBEAT_IVL_S if address.startswith("tcp://") else 0.0
        self._alive = alive
        self._frame = encoder.encode(protocol.Heartbeat())
        self._next = 0.0

    def maybe_send(self, dealer: zmq.Socket) -> None:
        """Call often (the processor thread's poll loop, and per message it drains): sends when one is due."""
        if not self.interval_s:
            return
        now = time.monotonic()
        if now >= self._next and self._alive():
            self._next = now + self.interval_s
            try:
                dealer.send(self._frame, zmq.NOBLOCK)
            except zmq.Again:  # no connection to queue it on (unbounded otherwise): the next one goes
                pass
