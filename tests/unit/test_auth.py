"""TCP engine addresses: CURVE keys from a shared secret, and peers without it refused (no engine needed)."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import stat
import time

import msgspec
import pytest
import zmq

from asyncllm import ConfigError, protocol
from asyncllm.auth import MIN_KEY_LENGTH, derive_keys, resolve_key, secure_client
from asyncllm.engine.channel import ConnectionWatch, open_dealer
from asyncllm.engine.connect import check_address
from asyncllm.engine.core_io import CoreIO
from asyncllm.procutil import free_tcp_port, private_ipc_dir, remove_dir

KEY = "a-shared-secret-of-32-characters"
PACKAGE_ROOTS = ("asyncllm", "workers", "kernels", "integrations")


@pytest.fixture()
def core_io(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ASYNCLLM_ENGINE_KEY", KEY)
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    io = CoreIO(address)
    yield io, address
    io.close()


def _hello(ctx: zmq.Context, address: str, key: str | None, plain: bool = False) -> tuple[zmq.Socket, ConnectionWatch]:
    if plain:  # a client that knows nothing of CURVE, watched before it connects (its one refusal is not missed)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        watch = ConnectionWatch(dealer)
        dealer.connect(address)
    else:
        dealer = open_dealer(ctx, address, key)
        watch = ConnectionWatch(dealer)
    _send_hello(dealer, refused=key != KEY)
    return dealer, watch


def _send_hello(dealer: zmq.Socket, refused: bool, pid: int | None = None) -> None:
    """A refused peer's send finds no connection once its handshake has failed, and would block for ever: it may
    time out (nothing of it reaches the core either way)."""
    dealer.setsockopt(zmq.SNDTIMEO, 2000)
    try:
        dealer.send(msgspec.msgpack.encode(protocol.Hello(pid=os.getpid() if pid is None else pid)))
    except zmq.Again:
        if not refused:
            raise


def _lost_within(watch: ConnectionWatch, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reason = watch.lost()
        if reason is not None:
            return reason
        time.sleep(0.02)
    return None


def test_keys_are_derived_and_distinct() -> None:
    keys = derive_keys(KEY)
    assert keys == derive_keys(KEY)  # both sides compute the same pairs
    assert len({keys.server_public, keys.server_secret, keys.client_public, keys.client_secret}) == 4
    assert zmq.curve_public(keys.client_secret) == keys.client_public
    other = derive_keys(KEY + "!")
    assert other.server_public != keys.server_public and other.client_public != keys.client_public


def test_tcp_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCLLM_ENGINE_KEY", raising=False)
    assert resolve_key("ipc:///tmp/x/engine.sock", None) is None
    with pytest.raises(ConfigError, match="ASYNCLLM_ENGINE_KEY"):
        check_address("tcp://127.0.0.1:5555")
    with pytest.raises(ConfigError, match="at least 16") as info:
        resolve_key("tcp://127.0.0.1:5555", "short")
    assert "short" not in str(info.value)  # a secret is never echoed
    assert resolve_key("tcp://127.0.0.1:5555", "x" * MIN_KEY_LENGTH) == "x" * MIN_KEY_LENGTH
    monkeypatch.setenv("ASYNCLLM_ENGINE_KEY", KEY)
    assert check_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    with pytest.raises(ConfigError):
        CoreIO("tcp://127.0.0.1:5555", key="short")


def test_unauthenticated_peers_are_refused_and_the_core_keeps_serving(core_io) -> None:
    io, address = core_io
    ctx = zmq.Context()
    try:
        strangers = [
            ("wrong key", _hello(ctx, address, "another-secret-of-enough-length")),
            ("no CURVE", _hello(ctx, address, None, plain=True)),
        ]
        # right server key, random client key: passes the encryption, fails the ZAP check
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        rogue.curve_serverkey = derive_keys(KEY).server_public
        rogue.curve_publickey, rogue.curve_secretkey = public, secret
        rogue_watch = ConnectionWatch(rogue)
        rogue.connect(address)
        _send_hello(rogue, refused=True, pid=1)
        strangers.append(("rogue client key", (rogue, rogue_watch)))
        for name, (_, watch) in strangers:
            assert _lost_within(watch, 15.0) is not None, name
        with pytest.raises(queue.Empty):
            io.inbox.get(timeout=0.3)  # not one frame of theirs reached the core

        friend, friend_watch = _hello(ctx, address, KEY)
        client_id, message = io.inbox.get(timeout=15)
        assert message == protocol.Hello(pid=os.getpid())
        io.send(client_id, protocol.Outputs([], None, 1.0))
        assert friend.poll(15000)
        assert msgspec.msgpack.decode(friend.recv(), type=protocol.CoreMessage) == protocol.Outputs([], None, 1.0)
        assert friend_watch.lost() is None
        for _, (dealer, watch) in [*strangers, ("friend", (friend, friend_watch))]:
            watch.close()
            dealer.close(linger=0)
    finally:
        ctx.destroy(linger=0)  # closes what an assertion above left open: term() alone would wait for them


def test_a_closed_core_is_reported_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_ENGINE_KEY", KEY)
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    io = CoreIO(address)
    ctx = zmq.Context()
    dealer, watch = _hello(ctx, address, KEY)
    try:
        io.inbox.get(timeout=15)
        io.close()
        reason = _lost_within(watch, 15.0)
        assert reason is not None and "closed" in reason
    finally:
        watch.close()
        dealer.close(linger=0)
        ctx.destroy(linger=0)  # closes what an assertion above left open: term() alone would wait for them


def test_secure_client_sets_curve_options() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        assert sock.mechanism == zmq.NULL
        secure_client(sock, derive_keys(KEY))
        assert sock.mechanism == zmq.CURVE and not sock.curve_server
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)  # closes what an assertion above left open: term() alone would wait for them


def test_private_ipc_dir_is_0700() -> None:
    path = private_ipc_dir()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert os.stat(path).st_uid == os.getuid()
    finally:
        remove_dir(path)
    assert not os.path.exists(path)


def test_no_pickle_on_the_wire() -> None:
    """Every cross-process message is msgspec: no module of the package imports pickle or sends Python objects.
    ``torch.load`` reads checkpoint files from disk (pytorch_model.bin) and, in the OpenAI server, vLLM's base64
    ``prompt_embeds`` of a server started with --enable-prompt-embeds, never an engine message, and only with
    ``weights_only=True`` (tensors and plain containers; no code runs)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill|marshal|shelve)\b|send_pyobj|recv_pyobj"
                         r"|multiprocessing\.connection|torch\.load\(", re.M)
    readers = ["asyncllm/models/pt_checkpoint.py", "integrations/openai_prompt_embeds.py"]
    offenders = [str(path.relative_to(root)) for top in PACKAGE_ROOTS for path in (root / top).rglob("*.py")
                 if pattern.search(path.read_text(encoding="utf-8"))]
    assert sorted(offenders) == readers
    for reader in readers:
        loads = re.findall(r"torch\.load\(([^)]*)\)", (root / reader).read_text(encoding="utf-8"))
        assert loads and all("weights_only=True" in args for args in loads)


def test_openai_server_binds_localhost_and_limits_requests_by_default() -> None:
    """`asyncllm serve` listens on 127.0.0.1 unless --host says otherwise, with finite request limits
    (their enforcement: tests/integrations/test_openai_asgi_errors.py::test_body_size_and_limits)."""
    from asyncllm.cli import _parser

    args = _parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"
    assert args.max_body_bytes == 64 << 20 and args.max_n == 128 and args.max_prompts == 2048


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://127.0.0.1",
                                     "tcp://:5555", "tcp://127.0.0.1:x", "tcp://127.0.0.1:*"])
def test_a_tcp_address_needs_a_host_and_a_port_zmq_serves_as_given(address: str, monkeypatch) -> None:
    """zmq wraps a port past 65535 round (99999 served at 34463, while the core announced 99999): refused."""
    monkeypatch.setenv("ASYNCLLM_ENGINE_KEY", KEY)
    with pytest.raises(ConfigError, match="port from 1 to 65535"):
        check_address(address)
    assert check_address("tcp://[::1]:65535") == "tcp://[::1]:65535"
