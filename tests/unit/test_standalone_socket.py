"""`asyncllm engine` claiming its Unix socket: a leftover socket of a killed core is removed; a live core's, or a file
that is not a socket, stops the start.

A listening socket is told by the kernel accepting the connection, not by a handshake with a deadline, so a live core
whose CPU is starved (or stopped, here) still owns its address."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from asyncllm.engine.standalone import _claim_socket
from asyncllm.errors import ConfigError


def _bound(path: Path, listen: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listen:
        sock.listen(1)
    return sock


def test_a_killed_cores_socket_file_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "core.sock"
    _bound(path, listen=False).close()  # the file stays, nobody listens: what SIGKILL leaves
    assert path.exists()
    _claim_socket(str(path))
    assert not path.exists()


def test_a_listening_core_keeps_its_address_even_when_it_never_answers(tmp_path: Path) -> None:
    path = tmp_path / "core.sock"
    with _bound(path, listen=True):  # listening, never accepting: a core stopped or starved of CPU
        with pytest.raises(ConfigError, match="already serves there"):
            _claim_socket(str(path))
        assert path.exists()


def test_a_missing_folder_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "run" / "core.sock"
    _claim_socket(str(path))
    assert (os.stat(path.parent).st_mode & 0o777) == 0o700 and not path.exists()


def test_a_file_that_is_not_a_socket_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "core.sock"
    path.write_text("precious")
    with pytest.raises(ConfigError, match="not a socket"):
        _claim_socket(str(path))
    assert path.read_text() == "precious"


def test_attaching_to_a_killed_cores_socket_file_fails_at_once(tmp_path: Path) -> None:
    """`AsyncEngine.connect` to an address whose core was killed (its socket file left): refused at once, as when no
    file is there, where the handshake waited ASYNCLLM_ENGINE_STARTUP_TIMEOUT_S (600 s) for a core."""
    import time

    from asyncllm.engine.connect import prepare_attached
    from asyncllm.errors import EngineDeadError

    path = tmp_path / "core.sock"
    _bound(path, listen=False).close()
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="no engine core listens .* left by a core that was killed"):
        prepare_attached(None, f"ipc://{path}", timeout_s=5.0)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0


def test_attaching_to_a_tcp_port_nobody_listens_on_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """tcp://: a refused connection (no core on that port) is refused at once too, where zmq retried it for
    ASYNCLLM_ENGINE_STARTUP_TIMEOUT_S."""
    import time

    from asyncllm.engine.connect import prepare_attached
    from asyncllm.errors import EngineDeadError
    from asyncllm.procutil import free_tcp_port

    monkeypatch.setenv("ASYNCLLM_ENGINE_KEY", "a shared secret for this test only")
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="no engine core listens .* connection was refused"):
        prepare_attached(None, f"tcp://127.0.0.1:{free_tcp_port()}", timeout_s=5.0)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
