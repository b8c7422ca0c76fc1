"""The host <-> core wire protocol's fingerprint (`protocol.wire_protocol`): the same in every process of one install,
another when a message's shape changes (not when only its docs do); a core refuses a host of another fingerprint
with an EngineFailed and keeps serving the others, and a host refuses a core from before the check."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Union

import msgspec
import pytest
import zmq

from asyncllm import EngineDeadError, SamplingParams, protocol
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.engine.client_liveness import ClientLiveness, process_identity
from asyncllm.engine.connect import handshake
from asyncllm.engine.core import EngineCore
from asyncllm.engine.processor import Processor
from asyncllm.engine.processor_outputs import error_from
from asyncllm.lora import LoRARequest

_WIRE = dict(tag=True, array_like=True, omit_defaults=True)


def _rebuilt(cls: type, options: dict, insert_after: str | None = None, doc: str | None = None,
             **types: Any) -> type:
    """`cls` again as a new struct class: `types` replace fields' types, a bool field goes after `insert_after`."""
    fields: list[tuple] = []
    for f in msgspec.structs.fields(cls):
        default = f.default if f.default is not msgspec.NODEFAULT else msgspec.field(default_factory=f.default_factory)
        kind = types.get(f.name, f.type)
        fields.append((f.name, kind) if f.required else (f.name, kind, default))
        if f.name == insert_after:
            fields.append(("inserted", bool, False))
    return msgspec.defstruct(cls.__name__, fields, namespace={"__doc__": doc or cls.__doc__}, **options)


def _host_messages(add_request: type) -> Any:
    return Union[tuple(add_request if m is protocol.AddRequest else m for m in protocol.HostMessage.__args__)]


def test_fingerprint_is_stable_across_computations_and_processes() -> None:
    fingerprint = protocol.wire_protocol()
    assert len(fingerprint) == 16 and fingerprint == protocol._fingerprint((protocol.HostMessage, protocol.CoreMessage))
    child = subprocess.run([sys.executable, "-c", "from asyncllm import protocol; print(protocol.wire_protocol())"],
                           capture_output=True, text=True, check=True, cwd="/",
                           env={**os.environ, "PYTHONHASHSEED": "7"})  # no str-hash-ordered part in the fingerprint
    assert child.stdout.strip() == fingerprint


def test_fingerprint_follows_the_shape_of_nested_structs_not_their_docs() -> None:
    sampling = dict(kw_only=True, omit_defaults=True, array_like=True)
    same = _rebuilt(protocol.AddRequest, _WIRE, params=_rebuilt(SamplingParams, sampling, doc="other words"))
    assert protocol._fingerprint((_host_messages(same), protocol.CoreMessage)) == protocol.wire_protocol()
    inserted = _rebuilt(SamplingParams, sampling, insert_after="top_p")  # today's break: a field mid-struct
    changed = _rebuilt(protocol.AddRequest, _WIRE, params=inserted)
    assert protocol._fingerprint((_host_messages(changed), protocol.CoreMessage)) != protocol.wire_protocol()
    core_side = _rebuilt(protocol.EngineFailed, _WIRE, insert_after="message")
    messages = Union[tuple(core_side if m is protocol.EngineFailed else m for m in protocol.CoreMessage.__args__)]
    assert protocol._fingerprint((protocol.HostMessage, messages)) != protocol.wire_protocol()


def test_fingerprint_follows_the_engine_configs_fields() -> None:
    """`Ready.config` is a plain dict read by `EngineConfig.from_dict`: a host and a core whose EngineConfig differ
    (a field added, renamed or retyped) are refused at the handshake, not by a confusing ConfigError after it."""
    messages = (protocol.HostMessage, protocol.CoreMessage)
    schema = protocol._config_schema()
    assert schema["cache_config"][0] == ["block_size", "int"]
    assert schema["speculative_config"][0] == ["num_speculative_tokens", "int"]  # a dict field's keys
    assert protocol._fingerprint(messages, schema) == protocol.wire_protocol()
    added = {**schema, "cache_config": [*schema["cache_config"], ["kv_cache_layout", "str"]]}
    retyped = {**schema, "cache_config": [["block_size", "int | None"], *schema["cache_config"][1:]]}
    assert len({protocol._fingerprint(messages, s) for s in (schema, added, retyped)}) == 3


def _core() -> tuple[EngineCore, list[tuple[bytes, Any]]]:
    """An `EngineCore` that answers Hellos (no scheduler or workers); returns what it sends."""
    sent: list[tuple[bytes, Any]] = []
    core = EngineCore.__new__(EngineCore)
    core.config, core.num_gpu_blocks = EngineConfig.create("dummy-model", block_size=4), 64
    core.clients, core.stats_reporter, core.liveness = set(), None, ClientLiveness()
    core.mm_cache = SimpleNamespace(attach=lambda client_id, ring: False)
    core.io = SimpleNamespace(send=lambda client, message: sent.append((client, message)))
    return core, sent


@pytest.mark.parametrize("host", ["", "0123456789abcdef"])  # a host from before the check; another install's
def test_core_refuses_a_host_of_another_wire_protocol_and_serves_the_others(host: str) -> None:
    core, sent = _core()
    assert core._handle(b"other", protocol.Hello(pid=1, wire_protocol=host)) is False
    (client, failed), = sent
    assert client == b"other" and isinstance(failed, protocol.EngineFailed)
    error = error_from(failed)  # what the host's start raises (`Processor._await_ready`)
    assert type(error) is EngineDeadError
    assert "different asyncllm wire protocols" in str(error) and "upgrade or restart both" in str(error)
    assert protocol.wire_protocol() in str(error) and (host or "unknown: older") in str(error)
    assert core.clients == set() and core.stats_reporter is None
    sent.clear()
    assert core._handle(b"ours", protocol.Hello(pid=2, wire_protocol=protocol.wire_protocol())) is True
    (client, ready), = sent
    assert client == b"ours" and isinstance(ready, protocol.Ready) and ready.wire_protocol == protocol.wire_protocol()
    assert ready.config == core.config.to_dict(wire=True)  # what an attached host's config is made of
    assert core.clients == {b"ours"} and core.stats_reporter == b"ours"
    sent.clear()  # the refused host's requests are not run (it never said a Hello the core took), nor left waiting
    assert core._handle(b"other", protocol.AddRequest("r", [1], SamplingParams(), [2], 0.0)) is False
    (client, outputs), = sent
    assert client == b"other" and [(d.request_id, d.finish_reason, d.error_type) for d in outputs.outputs] == [
        ("r", "abort", "EngineDeadError")] and "does not know this host" in outputs.outputs[0].error
    from asyncllm.engine.processor_outputs import _request_error

    assert type(_request_error("EngineDeadError", outputs.outputs[0].error)) is EngineDeadError  # what the host raises
    sent.clear()  # its control calls are answered too: their futures fail instead of waiting
    for call in (protocol.Sleep("s"), protocol.WakeUp("w"), protocol.AddLoRA("l", LoRARequest("a", 1, "/x")),
                 protocol.RemoveLoRA("r", 1)):
        assert core._handle(b"other", call) is False
    assert [(type(reply).__name__, reply.call_id, reply.error_type) for _, reply in sent] == [
        ("SleepModeDone", "s", "EngineDeadError"), ("SleepModeDone", "w", "EngineDeadError"),
        ("LoRAAdded", "l", "EngineDeadError"), ("LoRARemoved", "r", "EngineDeadError")]


def test_core_answers_a_probe_but_never_registers_it_nor_makes_an_anonymous_peer_the_reporter() -> None:
    """`connect()`'s probe Hello (its host may be killed before its Goodbye) gets a `Ready` and is no host of the core;
    a raw pid-0 Hello is a host, but never the engine-wide metrics reporter: nothing but its Goodbye removes it."""
    core, sent = _core()
    probe = protocol.Hello(pid=0, wire_protocol=protocol.wire_protocol(), probe=True)
    assert core._handle(b"probe", probe) is False
    (client, ready), = sent
    assert client == b"probe" and isinstance(ready, protocol.Ready) and ready.config == core.config.to_dict(wire=True)
    assert core.clients == set() and core.stats_reporter is None
    assert core._handle(b"anonymous", protocol.Hello(pid=0, wire_protocol=protocol.wire_protocol())) is True
    assert core.clients == {b"anonymous"} and core.stats_reporter is None
    assert core._handle(b"host", protocol.Hello(pid=os.getpid(), wire_protocol=protocol.wire_protocol(),
                                                process_identity=process_identity())) is True
    assert core.clients == {b"anonymous", b"host"} and core.stats_reporter == b"host"


def test_an_old_hosts_hello_decodes_to_no_fingerprint() -> None:
    old_hello = msgspec.msgpack.encode(["Hello", 4242, "ring"])  # the Hello of an asyncllm before the check
    hello = msgspec.msgpack.decode(old_hello, type=protocol.HostMessage)
    assert hello == protocol.Hello(4242, "ring") and hello.wire_protocol == ""


@pytest.fixture()
def old_core(tmp_path: Any) -> Any:
    """A core from before the check at an ipc:// address: it answers each Hello with a Ready without a fingerprint."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    address = f"ipc://{tmp_path}/core"
    router.bind(address)
    hellos: list[protocol.Hello] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            client, payload = router.recv_multipart()
            message = msgspec.msgpack.decode(payload, type=protocol.HostMessage)
            if isinstance(message, protocol.Hello):
                hellos.append(message)
                router.send_multipart([client, msgspec.msgpack.encode(protocol.Ready(64, 4, 128, 1))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield address, hellos
    stop.set()
    thread.join(timeout=10)
    router.close(linger=0)
    ctx.term()


def test_hosts_refuse_a_core_from_before_the_check(old_core: Any) -> None:
    address, hellos = old_core
    with pytest.raises(EngineDeadError, match="different asyncllm wire protocols .*unknown: older"):
        handshake(address, timeout_s=5)
    processor = Processor(address=address, tokenizer=None, eos_token_ids=[2], vocab_size=512, deliver=lambda *a: None,
                          core=None, stats_logger=None, startup_timeout_s=5)
    try:
        with pytest.raises(EngineDeadError, match="upgrade or restart both"):
            processor.start().result(timeout=10)
    finally:
        processor.close(shutdown_core=False)
    assert [hello.wire_protocol for hello in hellos] == [protocol.wire_protocol()] * 2  # both hosts said theirs
    assert [hello.process_identity for hello in hellos] == ["", process_identity()]  # a handshake is not watched
    assert [hello.probe for hello in hellos] == [True, False]  # the handshake's Hello is a probe


def test_core_answers_an_add_request_it_cannot_decode_with_an_error_for_its_id() -> None:
    """A value of a type its field does not take (a boolean JSON schema) fails that request: its caller never waits."""
    from asyncllm.engine.core_io import CoreIO
    from asyncllm.procutil import private_ipc_dir, remove_dir
    from asyncllm.structured.spec import StructuredOutputs

    folder = private_ipc_dir()
    io = CoreIO(f"ipc://{folder}/core")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        dealer.connect(f"ipc://{folder}/core")
        params = SamplingParams(structured=StructuredOutputs(json=True))  # type: ignore[arg-type]
        dealer.send(msgspec.msgpack.encode(protocol.AddRequest("req-7", [1, 2], params, [0], 0.0)))
        dealer.send(msgspec.msgpack.encode(["Goodbye", "not a bool"]))  # no id to answer: dropped
        reply = msgspec.msgpack.decode(dealer.recv(), type=protocol.CoreMessage)
        assert [(d.request_id, d.finish_reason) for d in reply.outputs] == [("req-7", "abort")]
        assert reply.outputs[0].error.startswith("request: the engine core could not decode it (Expected `str")
        assert io.inbox.empty()
    finally:
        dealer.close()
        ctx.term()
        io.close()
        remove_dir(folder)


def test_a_handshake_that_timed_out_says_goodbye_to_the_core_that_binds_late() -> None:
    """A probe waiting for a core still loading leaves its Hello queued: its Goodbye follows, so the core does not
    keep a dead host (which, the first to attach, would export the engine-wide metrics for good)."""
    from asyncllm.procutil import private_ipc_dir, remove_dir

    folder = private_ipc_dir()
    address = f"ipc://{folder}/core"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    got: list[Any] = []

    def bind_late() -> None:
        time.sleep(0.5)  # after the handshake gave up, before its linger ends
        router.bind(address)
        while len(got) < 2 and router.poll(3000):
            got.append(msgspec.msgpack.decode(router.recv_multipart()[1], type=protocol.HostMessage))

    thread = threading.Thread(target=bind_late, daemon=True)
    thread.start()
    try:
        with pytest.raises(EngineDeadError, match="no engine core answered"):
            handshake(address, timeout_s=0.3)
        thread.join(timeout=10)
        assert [type(m).__name__ for m in got] == ["Hello", "Goodbye"]
    finally:
        router.close(linger=0)
        ctx.term()
        remove_dir(folder)


@pytest.mark.parametrize("sent", [NotBuiltError("model", "/m.Q8_1.gguf", "dequantizing GGUF Q8_1 tensors (output)"),
                                  ConfigError("device", "cuda:9", "a device this machine has")],
                         ids=["not-built", "config"])
def test_a_workers_and_a_cores_config_errors_keep_their_class_and_message(sent: ConfigError) -> None:
    from asyncllm.workers.worker import error_message

    at_core = protocol.worker_failure(msgspec.msgpack.decode(msgspec.msgpack.encode(error_message(0, sent)),
                                                             type=protocol.WorkerError))
    failed = protocol.EngineFailed(type(sent).__name__, str(sent), protocol.config_error_parts(sent))
    at_host = error_from(msgspec.msgpack.decode(msgspec.msgpack.encode(failed), type=protocol.EngineFailed))
    assert type(at_core) is type(at_host) is type(sent)
    assert str(at_host) == str(sent) and at_core.value == at_host.value == sent.value
    assert str(at_core) == f"{sent} (worker rank 0)"
    if isinstance(sent, NotBuiltError):  # the rank note after the sentence; reaching the host, it stays there
        forwarded = protocol.EngineFailed("NotBuiltError", str(at_core), protocol.config_error_parts(at_core))
        assert at_core.feature == error_from(forwarded).feature == sent.feature
        assert str(error_from(forwarded)) == str(at_core)
