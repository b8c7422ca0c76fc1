"""A fork server: child processes started with torch already imported.

``python -m asyncllm.forkserver --address PATH`` imports torch, numpy, msgspec
and pyzmq once, then listens on a unix socket. When ``ASYNCLLM_FORKSERVER``
names that socket, `procutil.spawn_module` asks it for ``python -m module
args`` instead of starting an interpreter: the server forks, and the child
takes the caller's stdin pipe, stdout, stderr, working directory and
environment, then runs the module as ``__main__``. An engine start saves the
interpreter start and the torch import of its core and of every worker (about
a second of CPU each); the test suite starts one server per test process.

What a child does not get from the caller: variables read while the server
imported torch (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``) and ``PYTHONPATH``
are the server's. The server imports nothing of asyncllm's that reads the
environment, and never touches a GPU, so forking it is safe.

Protocol, one connection per child: the caller sends an 8-byte length and
three descriptors (stdin, stdout, stderr), then a msgpack body
``{module, args, env, cwd}``; the server answers the child's pid (8 bytes),
and later its exit status (8 bytes, ``Popen.returncode``'s convention). A
body ``{"list": true}`` instead asks for ``{pid: [caller pid, module]}`` of the
live children (tests use it to find an engine's workers).
"""

from __future__ import annotations

import argparse
import os
import runpy
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback

import msgspec

from asyncllm import envs

_LEN = struct.Struct("!q")
_PEERCRED = struct.Struct("3i")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("fork server connection closed mid-message")
        chunks += chunk
    return bytes(chunks)


def _exit_status(status: int) -> int:
    """`os.waitpid`'s status as `Popen.returncode` (minus the signal number when killed)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class _Server:
    """The accept / fork / reap loop; single-threaded, so forking it is safe."""

    def __init__(self, address: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address)
        os.chmod(address, 0o600)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(0, selectors.EVENT_READ, self._stdin)  # EOF: our parent is gone
        self.children: dict[int, tuple[socket.socket, int, str]] = {}  # pid -> (connection, caller pid, module)

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=0.02):
                key.data(key.fileobj)
            self._reap()

    def _stdin(self, _fd: object) -> None:
        if not os.read(0, 4096):
            os._exit(0)

    def _accept(self, _listener: object) -> None:
        conn, _ = self.listener.accept()
        try:
            self._handle(conn)
        except (OSError, ConnectionError, msgspec.DecodeError) as exc:
            print(f"asyncllm fork server: dropped a request: {exc}", file=sys.stderr, flush=True)
            conn.close()

    def _handle(self, conn: socket.socket) -> None:
        header, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
        if len(header) < _LEN.size:
            header += _recv_exact(conn, _LEN.size - len(header))
        request = msgspec.msgpack.decode(_recv_exact(conn, _LEN.unpack(header)[0]))
        if request.get("list"):
            listing = {pid: [caller, module] for pid, (_, caller, module) in self.children.items()}
            body = msgspec.msgpack.encode(listing)
            conn.sendall(_LEN.pack(len(body)) + body)
            conn.close()
            return
        caller = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
        pid = os.fork()
        if pid == 0:
            self._become_child(conn, fds, request)
        for fd in fds:
            os.close(fd)
        self.children[pid] = (conn, caller, request["module"])
        conn.sendall(_LEN.pack(pid))

    def _become_child(self, conn: socket.socket, fds: list[int], request: dict) -> None:
        code = 1
        try:
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            self.selector.close()
            self.listener.close()
            conn.close()
            for other, _, _ in self.children.values():
                other.close()
            code = _run_module(request)
        except BaseException:  # noqa: BLE001 - the child must never return into the server loop
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done == 0:
                continue
            conn = self.children.pop(pid)[0]
            try:
                conn.sendall(_LEN.pack(_exit_status(status)))
            except OSError:
                pass  # the caller is gone or no longer waits
            conn.close()


def _run_module(request: dict) -> int:
    """In the forked child: take the caller's directory and environment, run the module as ``__main__``."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy

    numpy.random.seed()  # siblings must not share the server's numpy stream (`random` reseeds itself at fork)
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


class ForkedProcess:
    """A child forked by the server, with the part of `subprocess.Popen` the engine uses."""

    def __init__(self, conn: socket.socket, pid: int, stdin_fd: int, args: list[str]) -> None:
        self._conn = conn
        self.pid = pid
        self.args = args
        self.stdin = os.fdopen(stdin_fd, "wb", buffering=0)
        self.returncode: int | None = None
        self._lock = threading.Lock()  # a monitor thread polls while another waits

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _status(self, timeout: float | None) -> int | None:
        ready = self.returncode is not None or self._readable(timeout)  # waits without the lock
        with self._lock:
            if self.returncode is not None or not ready:
                return self.returncode
            try:
                self.returncode = _LEN.unpack(_recv_exact(self._conn, _LEN.size))[0]
            except (ConnectionError, OSError):
                self.returncode = self._orphan_status()
            self._conn.close()
            return self.returncode

    def _readable(self, timeout: float | None) -> bool:
        poller = select.poll()  # not select(): descriptors past 1024 are fine
        try:
            poller.register(self._conn, select.POLLIN)
        except ValueError:
            return True  # another thread read the status and closed the connection
        return bool(poller.poll(None if timeout is None else timeout * 1000))

    def _orphan_status(self) -> int:
        """The server died before reporting: its children follow it (their parent is gone); wait for that."""
        while os.path.exists(f"/proc/{self.pid}"):
            time.sleep(0.01)
        return -signal.SIGKILL


def _request(address: str, body: dict, fds: list[int]) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        encoded = msgspec.msgpack.encode(body)
        socket.send_fds(conn, [_LEN.pack(len(encoded))], fds)
        conn.sendall(encoded)
    except OSError:
        conn.close()
        raise
    return conn


def fork_module(address: str, module: str, args: list[str], env: dict[str, str]) -> ForkedProcess:
    """``python -m module *args`` forked by the server at `address`, with this process's stdout and stderr,
    working directory, the environment `env` and a stdin pipe tied to our life (as `procutil.spawn_module`)."""
    read_end, write_end = os.pipe()
    try:
        body = {"module": module, "args": args, "env": env, "cwd": os.getcwd()}
        conn = _request(address, body, [read_end, 1, 2])  # descriptors 1 and 2, as a spawned child inherits
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    pid = _LEN.unpack(_recv_exact(conn, _LEN.size))[0]
    return ForkedProcess(conn, pid, write_end, [module, *args])


def children(address: str) -> dict[int, tuple[int, str]]:
    """The server's live children: pid -> (the pid that asked for it, its module)."""
    with _request(address, {"list": True}, [0, 1, 2]) as conn:
        size = _LEN.unpack(_recv_exact(conn, _LEN.size))[0]
        listing = msgspec.msgpack.decode(_recv_exact(conn, size))
    return {int(pid): (caller, module) for pid, (caller, module) in listing.items()}


def start_server(address: str, timeout: float = 60.0) -> subprocess.Popen:
    """Start a fork server listening at `address` (tied to this process's life); returns once it accepts."""
    from asyncllm import procutil

    proc = procutil.spawn_module("asyncllm.forkserver", ["--address", address], {envs.FORKSERVER.name: ""})
    deadline = time.monotonic() + timeout
    while not os.path.exists(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            procutil.stop_process(proc)
            raise RuntimeError(f"the fork server at {address} did not start (exit code {proc.poll()})")
        time.sleep(0.02)
    return proc


_MAINS = ("asyncllm.engine.core", "asyncllm.workers.worker", "asyncllm.workers.model_runner")


def _preload() -> None:
    """The imports every core and worker pays for, done once here. None of them reads the environment
    while importing (asyncllm reads it in functions; triton, which may, is not imported)."""
    import importlib

    for name in ("numpy", "safetensors.torch", "torch", "zmq", *_MAINS):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the child imports it again and reports the error there
            print(f"asyncllm fork server: not preloaded: {name}: {exc!r}", file=sys.stderr, flush=True)
    for name in _MAINS[:2]:  # run as __main__ in the child: keep their imports, not a second copy of them
        sys.modules.pop(name, None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m asyncllm.forkserver", description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="path of the unix socket to listen on")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; our parent decides
    _preload()
    _Server(args.address).serve()


if __name__ == "__main__":
    main()
