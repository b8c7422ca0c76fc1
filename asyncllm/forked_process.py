"""The caller's side of the fork server (asyncllm/forkserver.py): ask it for a child, then hold a `ForkedProcess`.

Protocol, one connection per request: the caller sends an 8-byte length with three descriptors (the child's
stdin, stdout, stderr), then a msgpack body ``{module, args, env, cwd}``. The server answers the child's pid (8
bytes) and later its exit status (8 bytes, `Popen.returncode`'s convention); or -1 and a msgpack list of the
variables whose values differ from the ones it started with (`startup_env`: read while it imported torch), in
which case the caller starts a new interpreter instead. A body ``{"list": true}`` asks for ``{pid: [caller pid,
module]}`` of the server's live children (tests use it to find an engine's workers).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Mapping

import msgspec

from asyncllm.procutil import proc_stat

__all__ = ["ForkRefused", "ForkedProcess", "children", "fork_module", "recv_exact", "startup_env", "LEN"]

LEN = struct.Struct("!q")
_REPLY_TIMEOUT_S = 60.0
"""Longest the caller waits for the server's pid reply (it serves one request at a time) before it starts a new
interpreter instead (a late child reads EOF on its stdin at once and exits)."""
_WAIT_SLICE_S = 0.1
"""Longest one wait for a status lasts before the connection is looked at again (another thread may close it)."""


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a new interpreter reads while it starts or imports torch and numpy: a forked child gets the
    server's, so a caller whose values differ is refused (and starts a new interpreter)."""
    return {name: value for name, value in env.items() if name.startswith(_STARTUP_PREFIXES) or name in _STARTUP_NAMES}


_STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH_", "ATEN_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "NPY_",
                     "NUMPY_", "MALLOC_", "LD_", "LC_")
_STARTUP_NAMES = ("LANG", "GLIBC_TUNABLES")


class ForkRefused(OSError):
    """The server would not fork this child: the caller's `startup_env` differs from the server's."""


def recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("fork server connection closed mid-message")
        chunks += chunk
    return bytes(chunks)


class ForkedProcess:
    """A child forked by the server, with the part of `subprocess.Popen` the engine uses (pid, stdin, returncode,
    poll, wait, send_signal, terminate, kill). Its exit status comes from the server; if the server died first, the
    child died with it (SIGKILL, its parent-death signal) and that is the status."""

    def __init__(self, conn: socket.socket, pid: int, stdin_fd: int, args: list[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.args = args
        self.stdin = os.fdopen(stdin_fd, "wb", buffering=0)
        self.returncode: int | None = None
        self._pidfd = _pidfd_open(pid)
        self._server_gone = False
        self._lock = threading.Lock()  # a monitor thread polls while another waits

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is None:
                self._read_status()  # a status already sent: the pid may be another process's by now
            if self.returncode is not None:
                return
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, sig)  # never a reused pid
                else:
                    os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _status(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self.returncode is None:
                    self._read_status()
                if self.returncode is not None:
                    return self.returncode
                watched = self._pidfd if self._server_gone else self._conn.fileno()
            left = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return None
            if watched is None or watched < 0:
                time.sleep(left)
            else:
                _readable(watched, left)

    def _read_status(self) -> None:
        """Under the lock: take the status if the server sent it, or notice that the server is gone."""
        if not self._server_gone and _readable(self._conn.fileno(), 0.0):
            try:
                self._finish(LEN.unpack(recv_exact(self._conn, LEN.size))[0])
                return
            except (ConnectionError, OSError):
                self._server_gone = True
        if self._server_gone and self._exited():
            self._finish(-signal.SIGKILL)

    def _exited(self) -> bool:
        if self._pidfd is not None:
            return _readable(self._pidfd, 0.0)
        fields = proc_stat(self.pid)
        return fields is None or fields[0] == "Z"  # a zombie nobody reaps has exited too

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:  # dropped without a wait
            os.close(self._pidfd)

    def _finish(self, code: int) -> None:
        self.returncode = code
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _readable(fd: int, timeout: float) -> bool:
    poller = select.poll()  # not select(): descriptors past 1024 are fine
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3, or the child is already gone and reaped
        return None


def _request(address: str, body: dict, fds: list[int]) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        encoded = msgspec.msgpack.encode(body)
        socket.send_fds(conn, [LEN.pack(len(encoded))], fds)
        conn.sendall(encoded)
    except OSError:
        conn.close()
        raise
    return conn


def fork_module(address: str, module: str, args: list[str], env: dict[str, str]) -> ForkedProcess:
    """``python -m module *args`` forked by the server at `address`, with this process's stdout and stderr
    (descriptors 1 and 2, as a spawned child inherits them), working directory, the environment `env` and a stdin
    pipe tied to our life (as `procutil.spawn_module`). `ForkRefused` or another `OSError` when it cannot."""
    read_end, write_end = os.pipe()
    conn = None
    try:
        conn = _request(address, {"module": module, "args": args, "env": env, "cwd": os.getcwd()},
                        [read_end, 1, 2])
        conn.settimeout(_REPLY_TIMEOUT_S)
        pid = LEN.unpack(recv_exact(conn, LEN.size))[0]
        conn.settimeout(None)
        if pid < 0:
            differ = msgspec.msgpack.decode(recv_exact(conn, LEN.unpack(recv_exact(conn, LEN.size))[0]))
            raise ForkRefused(f"the fork server started with other values of {', '.join(differ)}")
    except BaseException:
        os.close(write_end)
        if conn is not None:
            conn.close()
        raise
    finally:
        os.close(read_end)
    return ForkedProcess(conn, pid, write_end, [module, *args])


def children(address: str) -> dict[int, tuple[int, str]]:
    """The server's live children: pid -> (the pid that asked for it, its module)."""
    with _request(address, {"list": True}, []) as conn:
        size = LEN.unpack(recv_exact(conn, LEN.size))[0]
        listing = msgspec.msgpack.decode(recv_exact(conn, size))
    return {int(pid): (caller, module) for pid, (caller, module) in listing.items()}
