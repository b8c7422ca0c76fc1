"""``asyncllm serve``'s start, in vLLM's order: bind the listening socket, start the engine, then serve on that socket.

A port in use or a bad engine config (a device this machine lacks, a dtype or max_model_len the model cannot take)
is one ``asyncllm: error:`` line and exit 2 within seconds, before the model loads or the server starts; the app's
lifespan then finds the engine started (its `AsyncEngine.start` returns at once) and closes it at shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from asyncllm.cli_commands import uvicorn_kwargs
from asyncllm.cli_tracing import flush_traces
from asyncllm.engine.heap import freeze_startup_heap
from asyncllm.errors import AsyncLLMError, ConfigError
from asyncllm.integrations.openai_lora import start_server
from asyncllm.serve_drain import RequestGate

STARTUP_FAILURE = 3
"""uvicorn.run's exit status when the app's lifespan startup failed."""

logger = logging.getLogger(__name__)

__all__ = ["bound_socket", "serve_app", "bind_socket", "listen_url"]


@contextmanager
def bound_socket(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Iterator[socket.socket]:
    """`bind_socket`'s socket, closed (a --uds one removed) when the command ends."""
    from asyncllm.procutil import remove_file

    sock = bind_socket(args, parser)
    try:
        yield sock
    finally:
        sock.close()
        if args.uds is not None:
            remove_file(args.uds)


def served_what(args: argparse.Namespace) -> str:
    """The model serve's start-up line names: MODEL as given, the bundled default said as such (a MODEL taken by
    a flag's values would otherwise go unnoticed), or the attached core's."""
    names = f" as {', '.join(args.served_model_name)}" if args.served_model_name else ""
    if args.connect is not None:
        return f"the model of the engine at {args.connect}{names}"
    if args.model is None:
        return f"the bundled tiny model (no MODEL given){names}"
    return f"{args.model}{names}"


def serve_app(app: Any, engine: Any, sock: socket.socket, args: argparse.Namespace,
              parser: argparse.ArgumentParser) -> None:
    """Start `engine` and run the app's startup checks (`start_server`: its LoRA modules), then serve `app` (whose
    lifespan closes the engine) on `sock`; returns when a signal stopped the server. A `ConfigError` of the start is
    one line and exit 2, another `AsyncLLMError` (a worker died while loading) one line and exit 1; Ctrl-C while the
    model loads is exit 130 (as `asyncllm engine`'s), SIGTERM 143; a failed lifespan startup exit 3 (as
    `uvicorn.run`)."""
    import uvicorn

    gate = RequestGate(app)  # the --shutdown-timeout drain counts and refuses HTTP requests (serve_drain.py)
    config = uvicorn.Config(gate, **uvicorn_kwargs(args))
    _load_config(config, parser)
    print(f"[asyncllm] starting: serving {served_what(args)} on {listen_url(args, sock)} once the model is loaded",
          file=sys.stderr)
    server = uvicorn.Server(config)
    try:
        asyncio.run(_start_and_serve(app, engine, server, sock, args.uds, args.shutdown_timeout, gate))
    except ConfigError as exc:
        parser.error(str(exc))
    except AsyncLLMError as exc:
        sys.exit(f"asyncllm serve: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT that stopped it; before it started, the load was cut
        if not server.started:
            sys.exit(130)
    except asyncio.CancelledError:  # SIGTERM while the model loaded (`_start`)
        sys.exit(128 + signal.SIGTERM)
    if not server.started:  # the app's lifespan startup failed (uvicorn logged why): uvicorn.run's exit status
        sys.exit(STARTUP_FAILURE)


async def _start_and_serve(app: Any, engine: Any, server: Any, sock: socket.socket, uds: str | None,
                           drain: float, gate: RequestGate) -> None:
    await _start(app, engine)
    # uvicorn's signal handling from here on: SIGINT/SIGTERM stop it gracefully, then it re-raises the signal to the
    # handler it found, this one, which notes a SIGTERM: the process ends by it only once the engine's close ended
    # (the lifespan's close waits for the same one), the --uds socket removed first
    terms: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
    closing = _close_engine_on_exit(server, engine, drain, gate)
    try:
        await server.serve(sockets=[sock])
    finally:
        try:  # Ctrl-C cancels the wait below: the previous handler is put back all the same
            if closing:  # its stop of the engine core(s) ends before the process does; its error never hides serve's
                for error in await asyncio.gather(closing[0], return_exceptions=True):
                    if isinstance(error, Exception):
                        logger.warning("closing the engine at shutdown failed: %r", error)
        finally:
            signal.signal(signal.SIGTERM, previous)
        flush_traces()  # --otlp-traces-endpoint's last spans, before a SIGTERM ends the process (no atexit then)
        if terms:
            _remove_then_die(uds, signal.SIGTERM)


def _close_engine_on_exit(server: Any, engine: Any, drain: float, gate: RequestGate) -> list[asyncio.Task]:
    """Make uvicorn's first SIGINT/SIGTERM also start `engine.aclose()` (open streams end with finish_reason "abort",
    a queued one too), so that uvicorn's wait for open connections ends; else it waits for every stream, and the
    lifespan's close comes only after the last. With `drain` seconds (``--shutdown-timeout``, vLLM's drain shutdown)
    the close drains first (uvicorn's `handle_exit` has it close the listening socket at its next tick, within
    0.1 s: new connections are then refused): `gate` refuses new HTTP requests on connections still open (503) and
    waits up to `drain` seconds for those it accepted before (the engine takes their calls meanwhile: a beam
    search's next step, a body still being read); the close then aborts what is left.
    Returns the list that the close's task is put in."""
    loop, closing, handle_exit = asyncio.get_running_loop(), [], server.handle_exit

    async def drain_then_close() -> None:
        try:
            await gate.drain(drain)
        finally:  # cancelled during the drain: the engine is closed all the same
            await engine.aclose()

    def close() -> None:
        if not closing:
            closing.append(loop.create_task(drain_then_close() if drain else engine.aclose()))

    def on_exit(sig: int, frame: Any) -> None:  # a signal handler: the loop may be mid-step, so call_soon_threadsafe
        handle_exit(sig, frame)
        loop.call_soon_threadsafe(close)

    server.handle_exit = on_exit
    return closing


def _remove_then_die(path: str | None, signum: int, frame: Any = None) -> None:
    """A SIGTERM's default action (the process ends by the signal, as after `uvicorn.run`), the --uds socket at
    `path` removed first."""
    from asyncllm.procutil import remove_file

    if path is not None:
        remove_file(path)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


async def _start(app: Any, engine: Any) -> None:
    """`engine.start` and the OpenAI app's `start_server`, stopped by SIGTERM as by Ctrl-C (vLLM's `run_server` makes
    both a KeyboardInterrupt while the engine builds); whatever started is closed when the start fails."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        openai_server = getattr(getattr(app, "state", None), "openai_server", None)  # None: another ASGI app
        if openai_server is None:
            await engine.start()
        else:
            await start_server(openai_server)  # the engine's start, then its LoRA modules
    except BaseException:  # a bad config, a failed load, Ctrl-C, SIGTERM
        await engine.aclose()
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    freeze_startup_heap()  # the started server's long-lived objects out of the collector's oldest generation


def _load_config(config: Any, parser: argparse.ArgumentParser) -> None:
    """uvicorn's config loaded now: an unreadable --ssl-keyfile or --ssl-certfile is one line, not a traceback after
    the model loaded."""
    try:
        config.load()
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        parser.error(f"uvicorn could not load its config (--ssl-*): {exc}")


def bind_socket(args: argparse.Namespace, parser: argparse.ArgumentParser) -> socket.socket:
    """The server's socket, bound (not listening: a client is refused, not kept waiting, while the model loads); a
    port in use, an address not of this machine or a --uds path taken is one line and exit 2. A --uds socket is
    claimed first (a leftover of a killed server is removed; a file or a live server stops the start) and made
    0o666, as uvicorn makes its own."""
    from asyncllm.procutil import claim_socket

    try:
        if args.uds is None:
            return _bind_tcp(args.host, args.port)
        claim_socket(args.uds, "uds", args.uds, "a server")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(args.uds)
        os.chmod(args.uds, 0o666)
        return sock
    except ConfigError as exc:
        parser.error(str(exc))
    except OSError as exc:  # EADDRINUSE, EADDRNOTAVAIL, an unknown host name (socket.gaierror)
        where = f"--uds {args.uds}" if args.uds is not None else f"--host {args.host} --port {args.port}"
        parser.error(f"cannot bind {where}: {exc.strerror or exc}")


def _bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound as vLLM's `create_server_socket` binds it: IPv4 unless `host` is an IPv6 literal (a name
    such as localhost is its IPv4 address; "" every IPv4 interface; "::" every interface, IPv4 clients too, as
    Linux's IPV6_V6ONLY default is 0), SO_REUSEADDR (a port a stopped server left in TIME_WAIT is free). No
    SO_REUSEPORT: a port in use must fail."""
    sock = socket.socket(socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def listen_url(args: argparse.Namespace, sock: socket.socket) -> str:
    """Where the routes are, with the port `sock` got (--port 0: the kernel's pick); a --root-path proxy strips its
    prefix before them."""
    if args.uds is not None:
        return f"unix:{args.uds} (/v1)"
    host = f"[{args.host}]" if _is_ipv6(args.host) else args.host or "0.0.0.0"  # vLLM's: "" is 0.0.0.0
    return f"{'https' if args.ssl_certfile else 'http'}://{host}:{sock.getsockname()[1]}/v1"
