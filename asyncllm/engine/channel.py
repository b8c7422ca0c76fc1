"""The host's end of the connection to the engine core: one DEALER that notices when the core is gone.

A host that owns its core also polls the core process (`CoreProcess.exit_code`);
a host attached to a shared core (`AsyncEngine.connect`) has no process to
poll, so the connection itself must tell. The DEALER carries ZMTP heartbeats
(answered by libzmq's own I/O thread in the core, so a long step never looks
like a death), and a socket monitor reports the moment the connection drops:
the core process died (the kernel closes its end at once), its machine went
silent for `HEARTBEAT_TIMEOUT_MS`, or a CURVE handshake failed (wrong key).
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncllm.auth import derive_keys, secure_client

__all__ = ["HEARTBEAT_IVL_MS", "HEARTBEAT_TIMEOUT_MS", "open_dealer", "ConnectionWatch"]

HEARTBEAT_IVL_MS = 200
"""A ZMTP PING every this often while the connection is quiet."""
HEARTBEAT_TIMEOUT_MS = 1000
"""No traffic from the core for this long: the connection is dropped (and reported as lost)."""

_LOST_EVENTS = {
    zmq.EVENT_DISCONNECTED: "the connection to the engine core closed: the core process died or was stopped",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the engine core refused this host's key: ASYNCLLM_ENGINE_KEY differs",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the CURVE handshake with the engine core failed: "
                                          "ASYNCLLM_ENGINE_KEY differs from the core's",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the engine core speaks another security mechanism: "
                                         "a tcp:// core needs ASYNCLLM_ENGINE_KEY on both sides",
}


def open_dealer(ctx: zmq.Context, address: str, key: str | None, linger_ms: int = 0) -> zmq.Socket:
    """A DEALER connected to `address`, with heartbeats, and CURVE when `key` is given (tcp://)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, linger_ms)
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
