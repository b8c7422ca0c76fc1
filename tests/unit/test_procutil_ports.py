"""`procutil.free_tcp_port`: a port for a listener to bind later (the tests' tcp:// engine addresses)."""

from __future__ import annotations

import socket

from asyncllm import procutil


def test_a_free_port_lies_below_the_ephemeral_range_and_is_bindable(monkeypatch) -> None:
    """Outgoing connections take ports from the kernel's ephemeral range meanwhile: one picked there was taken
    before the rendezvous bound it (EADDRINUSE under load)."""
    monkeypatch.setattr(procutil, "_ephemeral_low", lambda: 32768)
    ports = {procutil.free_tcp_port() for _ in range(8)}
    assert all(32768 - 16384 <= port < 32768 for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports.pop()))
    monkeypatch.setattr(procutil, "_ephemeral_low", lambda: 0)  # no /proc: the kernel picks one
    assert procutil.free_tcp_port() > 0
