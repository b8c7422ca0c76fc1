"""Child processes that never outlive their parent, private socket folders (asyncllm/ipc_dirs.py), and claiming a
Unix socket path (`claim_socket`).

Children are started with `subprocess` running ``python -m <module>`` (a fresh
interpreter, like multiprocessing's spawn, with none of its atexit joins). The
parent keeps the write end of the child's stdin: when the parent dies, for any
reason, the kernel closes it and the child sees EOF and exits. On Linux the child also
asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), which ends it
even while its Python is hung holding the GIL and no watcher thread can run (save while an `at_orphan_exit`
cleanup is registered: a SIGKILL would skip it).
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import queue
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from asyncllm import envs
from asyncllm.errors import ConfigError, EngineDeadError
from asyncllm.ipc_dirs import private_ipc_dir as private_ipc_dir, remove_dir as remove_dir  # (asyncllm/ipc_dirs.py)

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PARENT_PID = envs.PARENT_PID_NAME


def spawn_module(module: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m module *args`` with a stdin pipe tied to our life.

    With ``ASYNCLLM_FORKSERVER`` set in the child's environment the child is forked by that server
    (asyncllm/forkserver.py) and the result is a `ForkedProcess` (asyncllm/forked_process.py), which has the
    `Popen` interface used here; when the server refuses or is gone, a new interpreter starts the child.
    """
    child_env = dict(os.environ)
    child_env.update(env or {})
    server = child_env.get(envs.FORKSERVER.name)
    if server:
        from asyncllm.forked_process import ForkRefused, fork_module

        try:
            return fork_module(server, module, args, child_env)  # type: ignore[return-value]
        except ForkRefused as exc:
            logger.info("%s: starting %s as a new interpreter", exc, module)
        except OSError as exc:
            logger.warning("fork server %s unreachable (%s): starting %s as a new interpreter", server, exc, module)
        child_env.pop(envs.FORKSERVER.name)  # nor do its own children ask it again
    # -P: never put the working directory on sys.path (a repo checkout's kernels/
    # folder would shadow Hugging Face's `kernels` package).
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    child_env[_PARENT_PID] = str(os.getpid())
    return _in_spawner_thread(lambda: subprocess.Popen(
        [child_executable(), *safe_path, "-m", module, *args],
        stdin=subprocess.PIPE,
        env=child_env,
        close_fds=True,
    ))


def child_executable() -> str:
    """The Python children run: multiprocessing's (`multiprocessing.set_executable` sets it for embedding hosts);
    in a virtual environment whose interpreter lies outside it (uWSGI's sys.executable is the base Python, without
    the venv's packages), the venv's bin/python."""
    from multiprocessing import spawn

    executable = os.fsdecode(spawn.get_executable())
    if executable != sys.executable or sys.prefix == sys.base_prefix:
        return executable  # set by multiprocessing.set_executable, or no venv to prefer
    prefix = os.path.abspath(sys.prefix)
    venv_python = os.path.join(prefix, "bin", "python")
    outside = os.path.commonpath([os.path.abspath(executable), prefix]) != prefix
    return venv_python if outside and os.access(venv_python, os.X_OK) else executable


_spawner: queue.SimpleQueue | None = None
_spawner_thread: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _in_spawner_thread(start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """Run `start` in this process's one spawner thread, which lives as long as the process. The kernel sends a
    child its parent-death signal when the *thread* that started it exits, and hosts start cores from threads that
    end before the engine does (asyncio.to_thread's executor at the end of asyncio.run, anyio's idle workers, a
    `SyncEngine`'s loop thread). Inline when the interpreter finalizes (its daemon threads, the spawner too, no
    longer run) and in the spawner thread itself (it would wait for itself)."""
    global _spawner, _spawner_thread
    if sys.is_finalizing() or threading.current_thread() is _spawner_thread:
        return start()
    with _spawner_lock:
        if _spawner is None:
            _spawner = queue.SimpleQueue()
            _spawner_thread = threading.Thread(target=_serve_spawns, args=(_spawner,), name="asyncllm-spawner",
                                               daemon=True)
            _spawner_thread.start()
        spawner = _spawner
    done: Future[subprocess.Popen] = Future()
    spawner.put((start, done))
    return done.result()


def _serve_spawns(spawner: queue.SimpleQueue) -> None:
    while True:
        start, done = spawner.get()
        try:
            done.set_result(start())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            done.set_exception(exc)


def _forget_spawner() -> None:
    global _spawner, _spawner_thread, _spawner_lock
    # a forked child has no spawner thread (nor a held lock)
    _spawner, _spawner_thread, _spawner_lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_spawner)


def forked(owner_pid: int | None) -> bool:
    """Whether this process was forked from `owner_pid` (the process an engine started in; None: not started):
    threads, event loops and sockets do not cross os.fork(), so the child cannot use what the parent runs."""
    return owner_pid is not None and owner_pid != os.getpid()


def check_not_forked(owner_pid: int | None, what: str) -> None:
    """An engine (`what`: AsyncEngine, SyncEngine) serves the process that started it: its threads, event loop and
    sockets do not cross os.fork() (gunicorn --preload, a Celery prefork master), so a forked child's request would
    wait forever."""
    if forked(owner_pid):
        raise EngineDeadError(
            f"this {what} was started in process {owner_pid}, before a fork: process {os.getpid()} cannot use it; "
            "create the engine after the fork (in the worker), see docs/integrations/task-runners.md")


def die_with_parent(parent: int | None = None) -> None:
    """In a new interpreter `spawn_module` started on Linux (or a child a fork server forked, `parent`: the server's
    pid): the kernel SIGKILLs us when the parent's spawner thread (so the parent) ends, even while our Python is hung
    holding the GIL and no watcher thread runs. A parent that died before the signal was armed is seen by its pid.
    Call it from the main thread: the kernel keeps the signal per thread. While an `at_orphan_exit` cleanup is
    registered (an engine core starting its workers) the signal stays disarmed: a SIGKILL would skip the cleanup,
    and the stdin and pid watchers end us instead. A standalone core (``asyncllm engine``) has no signal."""
    global _parent, _parent_thread
    expected = os.environ.pop(_PARENT_PID, "") if parent is None else str(parent)
    if not expected or not sys.platform.startswith("linux"):
        return
    _parent, _parent_thread = int(expected), threading.get_ident()
    _follow_parent()


_parent: int | None = None
"""The pid `die_with_parent` expects as our parent (None: no parent-death signal here)."""
_parent_thread = 0
"""The thread whose parent-death signal is armed (the kernel keeps it per thread)."""


def _follow_parent() -> None:
    """Arm the parent-death signal, or disarm it while a cleanup is registered; armed, exit at once if the parent
    is already gone."""
    if _parent is None:
        return
    if threading.get_ident() != _parent_thread:
        logger.warning("at_orphan_exit from thread %s leaves the parent-death signal as it was: the kernel keeps it "
                       "per thread (call it from the main thread)", threading.current_thread().name)
        return
    sig = 0 if _AT_ORPHAN_EXIT else signal.SIGKILL
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (%s): only the watcher threads end this process with its "
                       "parent", os.strerror(ctypes.get_errno()))
    elif sig and os.getppid() != _parent:  # the parent died before the signal was armed
        _exit_orphaned()


def exit_when_parent_dies(poll_s: float = 0.5) -> None:
    """In a child made by `spawn_module`: exit at once when the parent is gone.

    Two signals, either enough: EOF on stdin, or a changed parent pid; on Linux the kernel's parent-death
    signal besides (`die_with_parent`), for a process hung holding the GIL.
    """
    die_with_parent()
    parent = os.getppid()

    def read_stdin() -> None:
        # os.read, not sys.stdin: a thread blocked inside a buffered reader makes
        # interpreter shutdown abort ("_enter_buffered_busy").
        try:
            while os.read(0, 1):
                pass
        except OSError:
            pass
        _exit_orphaned()

    def poll_ppid() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        _exit_orphaned()

    threading.Thread(target=read_stdin, name="asyncllm-parent-eof", daemon=True).start()
    threading.Thread(target=poll_ppid, name="asyncllm-parent-pid", daemon=True).start()


_AT_ORPHAN_EXIT: list[Callable[[], None]] = []


def at_orphan_exit(func: Callable[[], None]) -> Callable[[], None]:
    """Call `func` (from a watcher thread) before `exit_when_parent_dies` ends this process, whose ``os._exit`` runs
    no finally and no atexit: a name that must not outlive it (a shared-memory segment) removed. Returns the call
    that takes `func` back (once it is freed otherwise). Until every such call is taken back the kernel's
    parent-death signal, which would skip `func`, is disarmed (`die_with_parent`): call both from the main thread."""
    _AT_ORPHAN_EXIT.append(func)
    _follow_parent()

    def forget() -> None:
        if func in _AT_ORPHAN_EXIT:
            _AT_ORPHAN_EXIT.remove(func)
            _follow_parent()

    return forget


def _exit_orphaned() -> None:
    for func in list(_AT_ORPHAN_EXIT):
        try:
            func()
        except Exception:  # noqa: BLE001 - exiting regardless
            logger.exception("cleanup before exiting (the parent died) failed")
    os._exit(0)


def ignore_group_signals() -> None:
    """In a child its parent owns (an engine core started by its host, a worker): ignore SIGINT and SIGTERM. Ctrl-C
    in a terminal and a service manager's stop (systemd's KillMode=control-group) signal the whole process group;
    the parent owns the shutdown order (a host may drain its requests first) and ends us with a goodbye, or by
    dying (`exit_when_parent_dies`). A standalone core installs its own handlers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def report_crashes() -> None:
    """In a child: a hard crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) prints every thread's Python stack to
    stderr, which the child shares with its parent, before the process dies."""
    faulthandler.enable(file=sys.stderr, all_threads=True)


_SIGNAL_HINTS = {
    signal.SIGKILL: "sent by another process or by the kernel's OOM killer, which dmesg names; no traceback",
    signal.SIGSEGV: "a crash; faulthandler printed its Python stack to stderr",
    signal.SIGABRT: "an abort; faulthandler printed its Python stack to stderr",
    signal.SIGBUS: "a crash; faulthandler printed its Python stack to stderr",
}


def describe_exit(code: int) -> str:
    """A child's exit status (`Popen.returncode`: minus the signal number when a signal killed it) in words."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"was killed by signal {-code}"
    hint = _SIGNAL_HINTS.get(sig)
    return f"was killed by {sig.name}" + (f" ({hint})" if hint else "")


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (the state first: field 3 is index 0); None when the
    process has no entry (gone, reaped, another pid namespace) or it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return [field.decode() for field in fields] or None


def first_exited(procs: list, wait_s: float, skip: int = -1, killed: bool = False) -> tuple[int, int] | None:
    """(index, exit code) of the first of `procs` but `skip` that has exited (`killed`: by a signal; one that exited
    with a code sent its own last words), polled for up to `wait_s` seconds (a peer's death reaches its
    collectives' partners before its parent sees it exit); None if none did."""
    deadline = time.monotonic() + wait_s
    while True:
        for index, proc in enumerate(procs):
            code = proc.poll() if index != skip else None
            if code is not None and (code < 0 or not killed):
                return index, code
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def stop_process(proc: subprocess.Popen, timeout: float = 5.0, grace: float = 0.0) -> None:
    """Give the child `grace` seconds to exit on its own, then close its stdin
    (it exits at once), then kill it if it has not exited `timeout` seconds later (no SIGTERM between: our
    children ignore it, `ignore_group_signals`)."""
    if grace > 0:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=timeout)
        return
    except subprocess.TimeoutExpired:
        proc.kill()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def free_tcp_port() -> int:
    """A port free on 127.0.0.1 now, for a listener to bind later (the tests' tcp:// engine addresses): below the
    kernel's ephemeral range where there is one (/proc), since a port there is what other processes' outgoing
    connections take meanwhile; else one the kernel picks. Still a race: a listener that can bind port 0 and tell
    its port binds that (the workers' torch.distributed store, `Worker.rendezvous_store`)."""
    low = _ephemeral_low()
    for port in random.sample(range(max(1024, low - 16384), low), 32) if low > 2048 else ():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's ip_local_port_range), 0 when unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def claim_socket(socket_path: str, field: str, value: str, owner: str) -> None:
    """Make `socket_path` free to bind: a missing folder is made (0700); a leftover socket that nobody listens on
    (its server was killed) is removed. Raises `ConfigError` on `field` = `value` when something that is not a
    socket is there, or `owner` (say "an engine core") listens there: binding would take its socket over."""
    parent = os.path.dirname(os.path.abspath(socket_path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700)
    try:
        mode = os.lstat(socket_path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(field, value, "a socket path: something that is not a socket is there")
    if listening(socket_path, field, value):
        raise ConfigError(field, value, f"a free address: {owner} already serves there")
    os.unlink(socket_path)  # a killed server left its socket behind: binding would fail


def listening(socket_path: str, field: str, value: str) -> bool:
    """Whether a process listens on the Unix socket (False: no file there, or one a killed server left): the kernel
    accepts or refuses the connection itself, so a live server whose CPU is starved still counts (a handshake with a
    deadline would have called it dead); a full backlog (a stopped server) blocks the connect: listening too."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(socket_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except (BlockingIOError, TimeoutError):
            return True
        except PermissionError:
            raise ConfigError(field, value, "a socket this user may connect to (another user's is there)") from None
    return True


def remove_file(path: str) -> None:
    """Remove `path` if it is there (a socket a server bound)."""
    try:
        os.unlink(path)
    except OSError:
        pass
