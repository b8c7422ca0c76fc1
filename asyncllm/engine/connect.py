"""Attach a host to an engine core that is already running (`AsyncEngine.connect`).

A standalone core (``asyncllm engine MODEL --address ipc:///...``) serves
several host processes, each with its own DEALER. A host that attaches asks the
core what it serves (the `Ready` reply carries the core's config: its model
folder, tokenizer, max_model_len, generation defaults, ...), takes it with its own
host-side fields on top (`config.HOST_SIDE_FIELDS`), then loads the tokenizer
itself: tokenization and detokenization stay in each host's processor thread, as
with an owned core.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from asyncllm import protocol
from asyncllm.auth import resolve_key
from asyncllm.config import EngineConfig
from asyncllm.engine.channel import ConnectionWatch, open_dealer
from asyncllm.engine.prepare import Prepared, prepare
from asyncllm.errors import ConfigError, EngineDeadError
from asyncllm.procutil import listening

__all__ = ["ATTACHED_FIELDS", "check_address", "default_address", "handshake", "prepare_attached"]


def default_address() -> str:
    """Where ``asyncllm engine`` listens and `AsyncEngine.connect()` looks by default: an ``ipc://``
    socket in a per-user folder of the temp dir (created 0700, so other users cannot attach)."""
    folder = os.path.join(tempfile.gettempdir(), f"asyncllm-{os.getuid()}")
    return f"ipc://{os.path.join(folder, 'engine.sock')}"


def check_address(address: object, key: str | None = None) -> str:
    """An engine address hosts may use: ``ipc://PATH``, or ``tcp://HOST:PORT`` with a shared secret.

    TCP lets any machine that reaches the port try to connect, so a tcp://
    address is served and reached only over CURVE with keys derived from
    `key` or ASYNCLLM_ENGINE_KEY (asyncllm/auth.py); without one it is refused.
    """
    if not isinstance(address, str):
        raise ConfigError("address", address, "an 'ipc:///path/to/socket' or 'tcp://host:port' string")
    if address.startswith("tcp://"):
        _check_tcp_port(address)
        resolve_key(address, key)
        return address
    if not address.startswith("ipc://") or len(address) <= len("ipc://"):
        raise ConfigError("address", address, "an 'ipc:///path/to/socket' or 'tcp://host:port' address")
    return address


def _check_tcp_port(address: str) -> None:
    """``tcp://HOST:PORT`` with a host and a port from 1 to 65535 (zmq wraps a larger one round: the core would serve
    at another port than the one it announces)."""
    if _tcp_endpoint(address) is None:
        raise ConfigError("address", address, "'tcp://host:port' with a port from 1 to 65535")


def _tcp_endpoint(address: str) -> tuple[str, int] | None:
    """A ``tcp://HOST:PORT`` address's host (an IPv6 one without its brackets) and port; None when it is not one."""
    host, _, port = address[len("tcp://"):].rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def handshake(address: str, timeout_s: float, key: str | None = None,
              closed: Callable[[], bool] | None = None) -> protocol.Ready:
    """Say hello on a throwaway DEALER, return the core's `Ready`, then say goodbye (shutdown=False); `closed`
    returning True ends the wait (the engine that waits was closed)."""
    ctx = zmq.Context()
    dealer = open_dealer(ctx, address, resolve_key(address, key), linger_ms=1000)  # linger: let the Goodbye out
    watch = ConnectionWatch(dealer)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(protocol.CoreMessage)
    try:
        dealer.send(encoder.encode(protocol.Hello(pid=0, wire_protocol=protocol.wire_protocol(), probe=True)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not dealer.poll(100):
                if closed is not None and closed():
                    raise EngineDeadError(f"the engine was closed while waiting for the engine core at {address}")
                lost = watch.lost()
                if lost is not None:
                    raise _CoreUnreachable(f"{lost} (engine address {address})")
                continue
            message = decoder.decode(dealer.recv())
            if isinstance(message, protocol.EngineFailed):
                raise EngineDeadError(f"the engine core at {address} failed: {message.message}")
            if isinstance(message, protocol.Ready):
                mismatch = protocol.wire_protocol_mismatch(protocol.wire_protocol(), message.wire_protocol)
                if mismatch is not None:  # a core from before the check: it took this Hello
                    raise EngineDeadError(f"the engine core at {address}: {mismatch}")
                return message
        raise EngineDeadError(
            f"no engine core answered at {address} within {timeout_s:.0f} s; start one with "
            f"`asyncllm engine MODEL --address {address}`",
        )
    finally:  # the core registers no probe; a core from before `Hello.probe` did: its Goodbye detaches it there
        with contextlib.suppress(zmq.ZMQError):  # never blocks: queued behind the Hello, or nowhere to go
            dealer.send(encoder.encode(protocol.Goodbye(shutdown=False)), zmq.NOBLOCK)
        watch.close()
        dealer.close()
        ctx.term()


class _CoreUnreachable(EngineDeadError):
    """No socket at the address, or the connection dropped during the handshake (a core that was stopping): a
    restart tries again."""


def prepare_attached(config: EngineConfig, address: str, timeout_s: float, key: str | None = None,
                     closed: Callable[[], bool] | None = None, host_fields: dict[str, Any] | None = None) -> Prepared:
    """Ask the core at `address` what it serves and load that tokenizer (runs in a worker thread).

    The host's config is the core's, with the `host_fields` given to `AsyncEngine.connect` on top (all of them
    `HOST_SIDE_FIELDS`, checked there). A core binds its socket before it loads the model, so a missing socket file
    means no core, not a slow one: that fails at once instead of after `timeout_s`.
    `closed` given (a core restart, `max_core_restarts`): the core may be restarting,
    so a missing socket or a dropped connection is tried again until `timeout_s`,
    or until `closed()` (the engine was closed meanwhile).
    """
    ready = _handshake_now(address, timeout_s, key) if closed is None else _await_handshake(address, timeout_s, key,
                                                                                            closed)
    if not ready.config:
        raise EngineDeadError(f"the engine core at {address} did not say what it serves (an older asyncllm?)")
    prepared = prepare(EngineConfig.from_dict({**ready.config, **(host_fields or {})}, from_core=True), resolved=True)
    if closed is not None:  # a restart: the host keeps its tokenizer, templates and served names
        _check_same_core(config, prepared.config, address)
    return prepared


ATTACHED_FIELDS = frozenset({
    "model", "tokenizer", "tokenizer_mode", "trust_remote_code", "skip_tokenizer_init", "revision",
    "tokenizer_revision", "hf_overrides", "enable_prompt_embeds", "generation_config", "override_generation_config",
    "max_logprobs", "logprobs_mode", "pooler_config", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
    "mm_processor_kwargs", "media_io_kwargs", "limit_mm_per_prompt", "mm_max_image_pixels", "runner", "convert",
    "dtype", "quantization", "load_format", "config_format", "kv_cache_dtype", "seed", "speculative_config",
    "structured_output_disable_any_whitespace",
})
"""The core-side fields a restarted shared core must keep: those a host acted on when it attached (its tokenizer,
chat template, generation defaults, logprobs, pooling, LoRA and media checks), and those that decide the weights
and the tokens served (dtype, quantization, load_format, config_format, kv_cache_dtype, seed: dummy weights and unseeded sampling,
speculative_config with its draft's folder, structured_output_disable_any_whitespace: a JSON schema's tokens).
The others (memory, parallelism, scheduling, timeouts, kernels: attention_backend, device, enforce_eager; and
max_model_len, fitted again as an owned core's) the host takes from the new core, download_dir too: the weights'
folders it resolved to are compared (model, tokenizer, speculative_config's draft), and the host resolves an
`update_weights` hub id in the core's cache."""


def _check_same_core(before: EngineConfig, now: EngineConfig, address: str) -> None:
    """`EngineDeadError` unless the restarted core at `address` serves what the host attached to first (its
    `ATTACHED_FIELDS`)."""
    old, new = before.to_dict(wire=True), now.to_dict(wire=True)
    changed = [f"{name} {old[name]!r} -> {new[name]!r}" for name in sorted(ATTACHED_FIELDS) if old[name] != new[name]]
    if changed:
        raise EngineDeadError(f"the engine core restarted at {address} serves something else ({'; '.join(changed)}): "
                              "this host keeps what it attached to; restart the host to attach to it")


def _handshake_now(address: str, timeout_s: float, key: str | None,
                   closed: Callable[[], bool] | None = None) -> protocol.Ready:
    path = address[len("ipc://"):] if address.startswith("ipc://") else None
    if path is not None and not listening(path, "address", address):  # no file, or one a killed core left
        left = " (its socket file is there, left by a core that was killed)" if os.path.exists(path) else ""
        raise _CoreUnreachable(f"no engine core listens at {address}{left}; start one with "
                               f"`asyncllm engine MODEL --address {address}`")
    if path is None and _refused(address):
        raise _CoreUnreachable(f"no engine core listens at {address} (the connection was refused); start one with "
                               f"`asyncllm engine MODEL --address {address}`")
    return handshake(address, timeout_s, key, closed)


def _refused(address: str) -> bool:
    """Whether a tcp:// address's machine refuses a connection (nothing listens on the port): zmq would retry it
    until the handshake's timeout. A silent machine, or an address that is no host:port, is left to the handshake."""
    endpoint = _tcp_endpoint(address)
    if endpoint is None:
        return False
    try:
        with socket.create_connection(endpoint, timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _await_handshake(address: str, timeout_s: float, key: str | None, closed: Callable[[], bool]) -> protocol.Ready:
    """`handshake` once a core listens at `address`, retried with backoff (0.1 s to 2 s) until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.1
    while True:
        try:
            return _handshake_now(address, max(deadline - time.monotonic(), 0.1), key, closed)
        except _CoreUnreachable:
            if time.monotonic() + delay_s > deadline or closed():
                raise
        _wait_unless(closed, delay_s)
        delay_s = min(delay_s * 2, 2.0)


def _wait_unless(closed: Callable[[], bool], seconds: float) -> None:
    """Sleep `seconds`, or less once `closed()` (an `aclose` does not wait out a backoff)."""
    end = time.monotonic() + seconds
    while not closed() and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))
