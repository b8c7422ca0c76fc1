"""A fork server: child processes started with torch already imported.

``python -m asyncllm.forkserver --address PATH`` imports torch, numpy, safetensors, pyzmq and the engine core's
and workers' modules once, then listens on a unix socket. When ``ASYNCLLM_FORKSERVER`` names that socket,
`procutil.spawn_module` asks it for ``python -m module args`` instead of starting an interpreter
(asyncllm/forked_process.py): the server forks, and the child takes the caller's stdin pipe, stdout, stderr,
working directory and environment, then runs the module as ``__main__``. An engine start saves the interpreter
start and the imports of its core and of every worker (about a second of CPU each); the test suite starts one
server per test process.

What a forked child cannot take from the caller: the variables a new interpreter reads while it starts or
imports torch (`startup_env`: ``PYTHON*``, ``TORCH*``, ``PYTORCH_*``, ``ATEN_*``, OpenMP's, MKL's, OpenBLAS's and
numpy's, ``MALLOC_*``, ``GLIBC_TUNABLES``, ``LD_*``, locale)
were the server's, so a caller whose values differ is refused and starts a new interpreter; sibling children
share the server's string-hash seed. The server never touches a GPU, runs one thread of its own (OpenBLAS may
start its pool while numpy imports; its fork handler covers it) and holds no lock while it forks. A child dies
with the server (its parent-death signal is SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import runpy
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import traceback

import msgspec

from asyncllm import envs
from asyncllm.forked_process import LEN, recv_exact, startup_env

_PEERCRED = struct.Struct("3i")
_REQUEST_TIMEOUT_S = 10.0
"""Longest a caller may take to send its request: the server serves one at a time."""
_MAX_REQUEST = 64 * 2**20
"""Longest request body (a child's environment and arguments: the engine config's JSON is the largest part)."""


def _exit_status(status: int) -> int:
    """`os.waitpid`'s status as `Popen.returncode` (minus the signal number when killed)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class _Request(msgspec.Struct, frozen=True):
    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str


class _Server:
    """The accept / fork / reap loop, in one thread."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.pid = os.getpid()
        if os.path.exists(address) and stat.S_ISSOCK(os.stat(address).st_mode):  # left by a killed server
            os.unlink(address)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mask = os.umask(0o177)  # the socket is 0600 from its creation
        try:
            self.listener.bind(address)
        finally:
            os.umask(mask)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        if stat.S_ISFIFO(os.fstat(0).st_mode):  # started by `procutil.spawn_module`: EOF when our parent is gone
            self.selector.register(0, selectors.EVENT_READ, self._stdin)
        self.startup = startup_env(os.environ)
        self.children: dict[int, tuple[socket.socket, int, str]] = {}  # pid -> (connection, caller pid, module)

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=0.02):
                key.data(key.fileobj)
            self._reap()

    def exit(self) -> None:
        if os.getpid() != self.pid:  # a child signalled before it reset the server's SIGTERM handler: die of it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        try:
            os.unlink(self.address)
        except OSError:
            pass
        os._exit(0)

    def _stdin(self, _fd: object) -> None:
        if not os.read(0, 4096):
            self.exit()

    def _accept(self, _listener: object) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(_REQUEST_TIMEOUT_S)
        fds: list[int] = []
        try:
            header, fds, _, _ = socket.recv_fds(conn, LEN.size, 3)
            if not header:  # a probe (`start_server`) or a caller that gave up
                conn.close()
                return
            header += recv_exact(conn, LEN.size - len(header))
            size = LEN.unpack(header)[0]
            if not 0 <= size <= _MAX_REQUEST:
                raise ValueError(f"a request of {size} bytes")
            body = recv_exact(conn, size)
            if msgspec.msgpack.decode(body, type=dict).get("list"):
                self._list(conn)
            else:
                self._fork(conn, msgspec.msgpack.decode(body, type=_Request), fds)
        except Exception as exc:  # noqa: BLE001 - one bad caller must not stop the server
            print(f"asyncllm fork server: dropped a request: {exc!r}", file=sys.stderr, flush=True)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def _list(self, conn: socket.socket) -> None:
        body = msgspec.msgpack.encode({pid: [caller, module] for pid, (_, caller, module) in self.children.items()})
        conn.sendall(LEN.pack(len(body)) + body)
        conn.close()

    def _fork(self, conn: socket.socket, request: _Request, fds: list[int]) -> None:
        if len(fds) != 3:
            raise ValueError(f"a child needs 3 descriptors (stdin, stdout, stderr), got {len(fds)}")
        theirs = startup_env(request.env)
        differ = sorted(name for name in set(theirs) | set(self.startup) if theirs.get(name) != self.startup.get(name))
        if differ:
            body = msgspec.msgpack.encode(differ)
            conn.sendall(LEN.pack(-1) + LEN.pack(len(body)) + body)
            conn.close()
            return
        caller = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._become_child(conn, fds, request, server)
        conn.settimeout(None)
        self.children[pid] = (conn, caller, request.module)
        conn.sendall(LEN.pack(pid))

    def _become_child(self, conn: socket.socket, fds: list[int], request: _Request, server: int) -> None:
        code = 1
        try:
            from asyncllm import procutil

            procutil.die_with_parent(server)  # disarmed while the core starts its workers: see at_orphan_exit
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
                conn.sendall(LEN.pack(_exit_status(status)))
            except OSError:
                pass  # the caller is gone or no longer waits
            conn.close()


def _run_module(request: _Request) -> int:
    """In the forked child: take the caller's directory and environment, run the module as ``__main__``."""
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as a new interpreter: a closed pipe raises, never kills
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy

    numpy.random.seed()  # siblings must not share the server's numpy stream (`random` reseeds itself at fork)
    sys.argv = [request.module, *request.args]
    try:
        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # as the interpreter does with sys.exit("message")
        return 1
    return 0


def start_server(address: str, timeout: float = 60.0) -> subprocess.Popen:
    """Start a fork server listening at `address` (tied to this process's life); returns once it accepts."""
    from asyncllm import procutil

    proc = procutil.spawn_module("asyncllm.forkserver", ["--address", address, "--owned"], {envs.FORKSERVER.name: ""})
    deadline = time.monotonic() + timeout
    while not _accepts(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            procutil.stop_process(proc)
            raise RuntimeError(f"the fork server at {address} did not start (exit code {proc.poll()})")
        time.sleep(0.02)
    return proc


def _accepts(address: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(address)  # the server drops this empty request
        except OSError:
            return False
    return True


_MAINS = ("asyncllm.engine.core", "asyncllm.workers.worker", "asyncllm.workers.model_runner")


def _preload() -> None:
    """The imports every core and worker pays for, done once here. asyncllm reads its environment in functions,
    never while importing, and triton (which may) is not imported. Nothing here may run torch or numpy work: an
    OpenMP pool started in the server would hang a child's first parallel region."""
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
    parser.add_argument("--owned", action="store_true", help="started by a host (`start_server`), which ends it by "
                        "closing its stdin: SIGTERM to the host's process group is ignored")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; our parent decides
    if args.owned:
        from asyncllm import procutil

        # A host ends us by closing our stdin; SIGTERM to its group (systemd's stop) must not kill the cores it
        # drains. Ignored before we listen: the host may be signalled as soon as we accept.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        procutil.die_with_parent()  # the kernel ends us with the host too, should our stdin watch hang
    _preload()
    server = _Server(args.address)
    if not args.owned:  # started by hand: SIGTERM stops it
        signal.signal(signal.SIGTERM, lambda *_: server.exit())
    server.serve()


if __name__ == "__main__":
    main()
