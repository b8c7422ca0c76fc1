"""A host attached over tcp:// sends `Heartbeat`s; the core detaches one silent past `host_heartbeat_timeout_s`
(asyncllm/engine/channel.py, asyncllm/engine/client_liveness.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from asyncllm import EngineDeadError, protocol
from asyncllm.config import EngineConfig
from asyncllm.engine import channel
from asyncllm.engine.client_liveness import ClientLiveness, HeardAt, mark_heard
from asyncllm.engine.core import EngineCore
from asyncllm.engine.core_io import CoreIO
from asyncllm.engine.processor import Processor
from asyncllm.engine.processor_outputs import error_from
from asyncllm.errors import ConfigError
from asyncllm.procutil import free_tcp_port


def test_a_tcp_host_silent_past_the_timeout_is_dead_and_one_that_beats_is_not() -> None:
    heard = {b"silent": HeardAt(time.monotonic() - 60)}  # its Hello came while the core loaded
    liveness = ClientLiveness(3.0, heard, interval_s=0)
    for host in (b"silent", b"beating"):
        liveness.watch(host, 0, "", heartbeat_interval_s=1.0)
    assert liveness.dead_clients() == {}  # timed from the Hello's handling, not its arrival
    liveness.watch(b"ipc", 0, "")  # sends no heartbeats: left to its pid watch and its Goodbye
    assert liveness.dead_clients() == {}
    now = time.monotonic()
    heard[b"silent"].at, heard[b"beating"].at = now - 3.5, now - 2.5  # no stamp for the ipc host: it is not timed
    dead = liveness.dead_clients()
    assert list(dead) == [b"silent"] and dead[b"silent"].endswith("s (host_heartbeat_timeout_s=3.0)")
    liveness.forget(b"silent")
    mark_heard(heard, b"silent")  # its heartbeat, heard by the I/O thread once it was forgotten
    assert liveness.dead_clients() == {} and list(heard) == [b"beating"]
    never = ClientLiveness(None, heard, interval_s=0)  # host_heartbeat_timeout_s=None
    never.watch(b"beating", 0, "", heartbeat_interval_s=1.0)
    assert never.dead_clients() == {}
    with pytest.raises(ConfigError, match="host_heartbeat_timeout_s"):
        EngineConfig.create("dummy-model", host_heartbeat_timeout_s=2.0)  # fewer than 3 heartbeats


def test_core_takes_heartbeats_quietly_and_tells_a_detached_host_it_was_dropped() -> None:
    sent: list[tuple[bytes, Any]] = []
    core = EngineCore.__new__(EngineCore)
    core.config, core.num_gpu_blocks = EngineConfig.create("dummy-model", block_size=4), 64
    core.clients, core.stats_reporter, core.liveness = set(), None, ClientLiveness(3.0, heard := {}, interval_s=0)
    core.mm_cache = SimpleNamespace(attach=lambda client_id, ring: False)
    core.io = SimpleNamespace(send=lambda client, message: sent.append((client, message)))
    hello = protocol.Hello(pid=0, wire_protocol=protocol.wire_protocol(), heartbeat_interval_s=1.0)
    assert core._handle(b"tcp", hello) is True
    heard[b"tcp"].at = time.monotonic() - 4
    assert list(core.liveness.dead_clients()) == [b"tcp"]
    sent.clear()
    assert core._handle(b"tcp", protocol.Heartbeat()) is False and sent == []  # nothing to answer, no outputs
    core.clients.clear()  # detached (`_remove_client`)
    assert core._handle(b"tcp", protocol.Heartbeat()) is False
    (client, failed), = sent
    assert client == b"tcp" and isinstance(failed, protocol.EngineFailed)
    error = error_from(failed)  # what the host's open streams get
    assert type(error) is EngineDeadError and "silent past host_heartbeat_timeout_s" in str(error)


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
def test_a_host_beats_over_tcp_only_and_the_cores_io_thread_times_it(scheme: str, tmp_path: Any) -> None:
    """Timed on receipt (`CoreIO.last_heard`), not when the busy loop reads its inbox: a long step does not make a
    host look silent."""
    key = "heartbeat-test-key-0123456789" if scheme == "tcp" else None
    address = f"tcp://127.0.0.1:{free_tcp_port()}" if scheme == "tcp" else f"ipc://{tmp_path}/core"
    io = CoreIO(address, key)
    processor = Processor(address=address, tokenizer=None, eos_token_ids=[2], vocab_size=512, engine_key=key,
                          deliver=lambda *a: None, core=None, stats_logger=None, startup_timeout_s=5)
    try:
        started = processor.start()
        client, hello = io.inbox.get(timeout=10)
        assert client not in io.last_heard  # not yet timed out by the core
        ClientLiveness(3.0, io.last_heard, interval_s=0).watch(client, 0, "", hello.heartbeat_interval_s)
        ready_at = time.monotonic()
        io.send(client, protocol.Ready(64, 4, 128, 1, wire_protocol=protocol.wire_protocol()))
        started.result(timeout=10)
        time.sleep(0.5)
        beats = 0
        while not io.inbox.empty():
            beats += isinstance(io.inbox.get_nowait()[1], protocol.Heartbeat)
        heard = io.last_heard.get(client)
        heard_at = None if heard is None else heard.at
    finally:
        processor.close(shutdown_core=False)
        io.close()
    if scheme == "tcp":  # at once, the next a second later (not at each poll)
        assert (hello.heartbeat_interval_s, beats) == (1.0, 1) and heard_at > ready_at
    else:
        assert (hello.heartbeat_interval_s, beats, heard_at) == (0.0, 0, None)  # left to its pid watch


def test_a_host_slower_than_the_core_still_beats_while_it_drains_outputs(monkeypatch) -> None:
    """Outputs that come faster than the host handles them keep its processor thread draining: it beats from
    there too, or the core would detach a live host."""
    monkeypatch.setattr(channel, "HOST_HEARTBEAT_IVL_S", 0.05)
    key = "heartbeat-test-key-0123456789"
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    io = CoreIO(address, key)
    processor = Processor(address=address, tokenizer=None, eos_token_ids=[2], vocab_size=512, engine_key=key,
                          deliver=lambda *a: None, core=None, stats_logger=None, startup_timeout_s=5)
    handle = processor._on_core_message
    processor._on_core_message = lambda dealer, payload: (time.sleep(0.004), handle(dealer, payload))
    try:
        started = processor.start()
        client, _ = io.inbox.get(timeout=10)
        io.send(client, protocol.Ready(64, 4, 128, 1, wire_protocol=protocol.wire_protocol()))
        started.result(timeout=10)
        io.send(client, protocol.Outputs(outputs=[]))  # the host drains from here on
        time.sleep(0.05)
        while not io.inbox.empty():
            io.inbox.get_nowait()
        flood_until = time.monotonic() + 0.4
        while time.monotonic() < flood_until:  # twice as fast as the host handles them
            io.send(client, protocol.Outputs(outputs=[]))
            time.sleep(0.002)
        beats = 0
        while not io.inbox.empty():
            beats += isinstance(io.inbox.get_nowait()[1], protocol.Heartbeat)
    finally:
        processor.close(shutdown_core=False)
        io.close()
    assert 4 <= beats <= 10  # one every 0.05 s: rate-limited still
