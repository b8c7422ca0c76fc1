"""The core buffers outputs for a host that stops reading, never drops them (asyncllm/engine/core_io.py,
asyncllm/engine/channel.py `unbounded`): at zmq's default high-water mark its ROUTER silently dropped what it sent
a host stalled for ~2,500 steps, and a dropped finishing delta left that stream waiting forever."""

from __future__ import annotations

import os
import time

import msgspec
import zmq

from asyncllm import protocol
from asyncllm.engine.channel import open_dealer
from asyncllm.engine.core_io import CoreIO
from asyncllm.engine.processor import Processor
from asyncllm.engine.processor_requests import Submit

_STEPS = 3000


def _hello(ctx: zmq.Context, io: CoreIO, address: str, rcvhwm: int) -> tuple[zmq.Socket, bytes]:
    """A host DEALER that said hello; `rcvhwm` 1: it stands for a stopped host, whose process reads nothing."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, rcvhwm)
    dealer.connect(address)
    dealer.send(msgspec.msgpack.encode(protocol.Hello(pid=os.getpid(), wire_protocol=protocol.wire_protocol())))
    client_id, _ = io.inbox.get(timeout=10)
    return dealer, client_id


def test_a_host_that_stops_reading_gets_every_output_in_order_once_it_reads(tmp_path) -> None:
    address = f"ipc://{tmp_path}/core.sock"
    io = CoreIO(address)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    try:
        stalled, stalled_id = _hello(ctx, io, address, rcvhwm=1)
        reading, reading_id = _hello(ctx, io, address, rcvhwm=1000)
        stats = protocol.SchedulerStats()
        for step in range(_STEPS):  # one decode step's tokens per Outputs, as the busy loop sends them
            io.send(stalled_id, protocol.Outputs([], stats, time.time(), token_req_ids=["r"] * 8,
                                                 token_ids=[step] * 8))
        io.send(reading_id, protocol.Outputs([], None, time.time()))
        assert reading.poll(10_000)  # the I/O thread sends in order: every output above went to the ROUTER first
        decoder = msgspec.msgpack.Decoder(protocol.CoreMessage)
        got = []
        while len(got) < _STEPS and stalled.poll(1000):
            got.append(decoder.decode(stalled.recv()).token_ids[0])
        assert got == list(range(_STEPS))
    finally:
        ctx.destroy()
        io.close()


def test_the_hosts_dealer_queues_without_bound_and_reads_the_core_between_added_requests() -> None:
    """The DEALER's own thread keeps taking the core's outputs while the processor thread is busy; a burst of
    requests to add is interleaved with reading them."""
    ctx = zmq.Context()
    dealer = open_dealer(ctx, "ipc:///tmp/asyncllm-no-core.sock", None)
    assert (dealer.getsockopt(zmq.SNDHWM), dealer.getsockopt(zmq.RCVHWM)) == (0, 0)
    dealer.close()
    ctx.term()
    processor = Processor(address="ipc:///tmp/asyncllm-no-core.sock", tokenizer=None, eos_token_ids=[2],
                          vocab_size=10, deliver=lambda batch, stats: None, core=None, stats_logger=None,
                          startup_timeout_s=1)
    calls: list[str] = []
    processor._add_request = lambda dealer, job: calls.append("add")
    processor._read_core = lambda dealer, heartbeat: calls.append("read")
    try:
        for _ in range(2):
            processor._jobs.put(Submit.__new__(Submit))
        assert processor._handle_jobs(None, heartbeat=object())
        assert calls == ["add", "read", "add", "read"]
    finally:
        processor._doorbell_pull.close(linger=0)  # the thread's to close, never started here
        processor.close(shutdown_core=False)
