"""A standalone engine core that several host processes share (``asyncllm engine MODEL``).

An owned core (started by `AsyncEngine`) exits when its host dies. A standalone
core runs in the foreground of its own process, is not tied to any host, binds
a known ``ipc://`` address that hosts attach to with `AsyncEngine.connect`, and
lives until SIGTERM or SIGINT, when it stops its workers and removes its socket.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType

from asyncllm import envs, protocol
from asyncllm.bundled import model_label
from asyncllm.child_logging import configure_child_logging
from asyncllm.config import EngineConfig
from asyncllm.config_model import AUTO_MAX_MODEL_LEN
from asyncllm.engine.connect import check_address
from asyncllm.engine.core import EngineCore
from asyncllm.engine.core_io import CoreIO
from asyncllm.engine.prepare import prepare
from asyncllm.errors import NotBuiltError
from asyncllm.procutil import claim_socket, remove_file, report_crashes

logger = logging.getLogger("asyncllm.engine.core")

__all__ = ["run_standalone_core"]


def run_standalone_core(config: EngineConfig, address: str, on_ready: Callable[[], None] | None = None) -> None:
    """Load the model, serve hosts on `address` until SIGTERM/SIGINT, then shut down cleanly.

    `on_ready` is called once the core serves (the CLI prints the address).
    """
    check_address(address)
    if config.data_parallel_size > 1:  # hosts balance over replicas; one address would need a balancing core
        raise NotBuiltError("data_parallel_size", config.data_parallel_size,
                            "data parallelism in a standalone engine core (`asyncllm engine`)")
    configure_child_logging("core")
    report_crashes()
    envs.check_at_start()
    term = signal.signal(signal.SIGTERM, _interrupt_load)  # while it loads, SIGTERM ends it as Ctrl-C does
    try:
        core, io, socket_path = _load(config, address)
    except BaseException:
        signal.signal(signal.SIGTERM, term)
        raise
    previous = {**_install_stop_handlers(core), signal.SIGTERM: term}  # (no gap where SIGTERM kills it at once)
    try:
        if on_ready is not None:
            on_ready()
        core.run()
    finally:
        try:  # a second SIGTERM/Ctrl-C while stopping is logged, not fatal: the hosts are told, the socket removed
            _stop(core, io, socket_path)
        finally:
            _restore(previous)


def _load(config: EngineConfig, address: str) -> tuple[EngineCore, CoreIO, str | None]:
    """Bind `address` and start the core (its model, its workers); what a failure (or Ctrl-C, or SIGTERM) left bound
    is closed and its socket file removed."""
    prepared = prepare(config, decodes_images=False)  # the model folder and max_model_len, as a host would
    model_name = model_label(config.model)  # as given (a hub id, not its folder): what attached hosts label
    auto_fit, config = config.max_model_len == AUTO_MAX_MODEL_LEN, prepared.config
    socket_path = address[len("ipc://"):] if address.startswith("ipc://") else None  # tcp://: CURVE (auth.py)
    if socket_path is not None:
        _claim_socket(socket_path)
    io = CoreIO(address)
    try:
        return EngineCore(config, io, prepared.hf_config_json, auto_fit, model_name), io, socket_path
    except BaseException:
        io.close()
        if socket_path is not None:
            remove_file(socket_path)
        raise


def _interrupt_load(signum: int, frame: FrameType | None) -> None:
    """SIGTERM before the core serves (a service stopped while the model loads): raised as Ctrl-C's
    KeyboardInterrupt is, so that the start's cleanup runs (its workers stopped, its socket removed) where the
    default action ended the process at once and left them (its socket file, the workers' folder and ring)."""
    raise SystemExit(128 + signum)


def _stop(core: EngineCore, io: CoreIO, socket_path: str | None) -> None:
    for client_id in core.clients:  # attached hosts fail their requests at once instead of hanging
        io.send(client_id, protocol.EngineFailed("EngineDeadError", "the standalone engine core stopped"))
    core.shutdown()
    io.close()
    if socket_path is not None:
        remove_file(socket_path)


def _claim_socket(socket_path: str) -> None:
    claim_socket(socket_path, "address", f"ipc://{socket_path}", "an engine core")


def _install_stop_handlers(core: EngineCore) -> dict[int, object]:
    """SIGTERM and SIGINT end `core.run()`; a repeat is only logged (the core is stopping already)."""
    received: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if received:
            logger.info("received %s while stopping: the engine core still stops its workers and removes its "
                        "socket first", name)
        else:
            logger.info("received %s: stopping the engine core", name)
        received.append(signum)
        core.stop()

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
