"""One standalone engine core (`asyncllm engine`) shared by two host processes (`AsyncEngine.connect`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest
from transformers import AutoTokenizer

from asyncllm import AsyncEngine, ConfigError, EngineDeadError, LoRARequest, SamplingParams
from asyncllm import protocol
from asyncllm.engine.channel import open_dealer
from asyncllm.engine.client_liveness import _machine, _start_time
from asyncllm.engine.connect import handshake
from hf_reference import hf_greedy
from lora_utils import make_adapter, peft_greedy

PROMPTS = ["def main():", "import os\n", "class Config:"]
MAX_TOKENS = 24

HOST = textwrap.dedent('''
    import asyncio, json, pathlib, sys, time
    from asyncllm import AsyncEngine, SamplingParams

    address, barrier, me, prompts = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])

    async def one(engine, prompt):
        ids, start = [], time.time()
        async for delta in engine.stream(prompt, SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True)):
            ids += delta.token_ids
        return {"ids": ids, "start": start, "end": time.time()}

    async def main():
        async with AsyncEngine.connect(address, disable_log_stats=True) as engine:
            (barrier / me).touch()
            while len(list(barrier.iterdir())) < 2:  # both hosts attached: stream at the same time
                await asyncio.sleep(0.01)
            results = await asyncio.gather(*(one(engine, p) for p in prompts))
            print(json.dumps({"model": engine.config.model, "results": results}))

    asyncio.run(main())
''' % MAX_TOKENS)


def _python(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", *args], **kwargs)


def _start_core(model: str, folder: Path, *args: str) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{folder / 'run' / 'engine.sock'}"
    proc = _python("-m", "asyncllm", "engine", model, "--address", address, "--disable-log-stats", *args,
                   stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(address[len("ipc://"):]):
        assert proc.poll() is None and time.monotonic() < deadline, "the standalone core did not start"
        time.sleep(0.05)
    handshake(address, timeout_s=120)  # returns once the model is loaded
    return proc, address


CORE_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-logprobs", "30", "--stream-interval", "2")
"""LoRA on (two slots): the base model's outputs are unchanged, and the adapter test needs no core of its own; a
core-side and a host-side field that hosts take from the core (test_each_host_has_its_own_request_ids)."""


@pytest.fixture(scope="module")
def core(tiny_llama: str, tmp_path_factory):
    proc, address = _start_core(tiny_llama, tmp_path_factory.mktemp("core"), *CORE_FLAGS)
    yield proc, address
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_two_hosts_share_one_core(core, tiny_llama: str, tmp_path: Path) -> None:
    proc, address = core
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    hosts = [_python("-c", HOST, address, str(barrier), name, json.dumps(prompts), stdout=subprocess.PIPE, text=True)
             for name, prompts in (("a", PROMPTS), ("b", PROMPTS[::-1]))]
    outputs = [json.loads(host.communicate(timeout=180)[0]) for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0]

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected = {p: hf_greedy(tiny_llama, tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS}
    assert [r["ids"] for r in outputs[0]["results"]] == [expected[p] for p in PROMPTS]
    assert [r["ids"] for r in outputs[1]["results"]] == [expected[p] for p in PROMPTS[::-1]]
    assert outputs[0]["model"] == outputs[1]["model"] == tiny_llama  # learnt from the core's Ready
    spans = [(r["start"], r["end"]) for out in outputs for r in out["results"]]
    a_end = max(end for _, end in spans[:3])
    b_start = min(start for start, _ in spans[3:])
    assert b_start < a_end  # the two hosts' requests were in the core at the same time

    assert proc.poll() is None  # the hosts detached without stopping the shared core
    assert handshake(address, timeout_s=10).config["model"] == tiny_llama


async def test_each_host_has_its_own_request_ids(core, tiny_llama: str) -> None:
    """Two hosts run requests of the same id at once, both token-exact; one aborting its id leaves the other's running
    (the core keys a request by its host and id: asyncllm/engine/request_keys.py)."""
    _, address = core
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    expected = [hf_greedy(tiny_llama, tokenizer(p).input_ids, n) for p, n in ((PROMPTS[0], 40), (PROMPTS[1], 200))]

    async def collect(stream) -> list[int]:
        return [t async for delta in stream for t in delta.token_ids]

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async with AsyncEngine.connect(address, disable_log_stats=True) as a, \
            AsyncEngine.connect(address, disable_log_stats=True, stream_interval=1) as b:
        assert (a.config.max_logprobs, a.config.stream_interval, a.config.max_loras) == (30, 2, 2)  # the core's
        assert (b.config.max_logprobs, b.config.stream_interval) == (30, 1)  # its own host-side field
        assert await asyncio.gather(collect(a.stream(PROMPTS[0], greedy(40), request_id="same")),
                                    collect(b.stream(PROMPTS[1], greedy(40), request_id="same"))) \
            == [expected[0], expected[1][:40]]
        b_stream = b.stream(PROMPTS[1], greedy(200), request_id="again")
        b_ids = (await anext(b_stream)).token_ids
        async for _ in a.stream(PROMPTS[0], greedy(40), request_id="again"):
            break  # a aborts its "again" one token in, long before b's 200 tokens
        b_ids += await asyncio.wait_for(collect(b_stream), 120)  # had a's abort ended b's request, b would wait
        assert b_ids == expected[1]


async def test_each_host_has_its_own_lora_ids(core, tiny_llama: str, tmp_path: Path) -> None:
    """Two hosts name different adapters with one lora_int_id, each gets its own adapter's tokens (PEFT's); a host
    attached after the adapter was retrained in place (a redeployed API server, numbering its adapters from 1
    again) gets the new weights, not the core's cached old ones (asyncllm/engine/request_keys.py)."""
    _, address = core
    a1, a2 = (make_adapter(tiny_llama, str(tmp_path / name), seed=seed) for name, seed in (("a1", 1), ("a2", 2)))
    served = tmp_path / "served"
    shutil.copytree(a1, served)
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 12]
    expected = [peft_greedy(tiny_llama, path, prompt, 12) for path in (a1, a2)]
    assert expected[0] != expected[1]

    async def greedy(engine: AsyncEngine, lora: LoRARequest) -> list[int]:
        stream = engine.stream({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12,
                                                                             ignore_eos=True), lora_request=lora)
        return [t async for delta in stream for t in delta.token_ids]

    async with AsyncEngine.connect(address, disable_log_stats=True) as b:
        async with AsyncEngine.connect(address, disable_log_stats=True) as a:
            assert await asyncio.gather(greedy(a, LoRARequest("sql", 1, str(served))),
                                        greedy(b, LoRARequest("chat", 1, a2))) == expected
        shutil.rmtree(served)
        shutil.copytree(a2, served)  # retrained in place while the core kept running
        async with AsyncEngine.connect(address, disable_log_stats=True) as redeployed:
            assert await greedy(redeployed, LoRARequest("sql", 1, str(served))) == expected[1]


def _engine_gauges(registry: CollectorRegistry) -> list[str]:
    """The engine-wide series this host's registry exports (one of them: the running requests' gauge)."""
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith("asyncllm:num_requests_running")]


async def test_a_killed_host_is_dropped_by_the_core(core) -> None:
    """A host killed without a Goodbye (SIGKILL, the OOM killer): within about a second the core aborts its requests
    (their KV blocks and batch slots are free) and another host exports the engine-wide metrics in its place
    (asyncllm/engine/client_liveness.py). A `sleep` process stands for the killed host: the Hello names its pid."""
    _, address = core
    child = subprocess.Popen(["sleep", "60"])
    ctx = zmq.Context()
    dealer = open_dealer(ctx, address, None)
    registry = CollectorRegistry()

    async def until(predicate, timeout_s: float) -> float:
        start = time.monotonic()
        while not predicate():
            assert time.monotonic() - start < timeout_s, engine.stats()
            await asyncio.sleep(0.05)
        return time.monotonic() - start

    try:
        dealer.send(msgspec.msgpack.encode(protocol.Hello(child.pid, wire_protocol=protocol.wire_protocol(),
                                                          process_identity=f"{_machine()} {_start_time(child.pid)}")))
        assert dealer.poll(30_000) and isinstance(msgspec.msgpack.decode(dealer.recv(), type=protocol.CoreMessage),
                                                  protocol.Ready)  # the first host attached: it reports
        dealer.send(msgspec.msgpack.encode(protocol.AddRequest(
            "long", [5, 17, 42], SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True), [], time.time())))
        async with AsyncEngine.connect(address, disable_log_stats=True, prometheus_registry=registry) as engine:
            await engine.generate("hi", SamplingParams(max_tokens=1))
            await until(lambda: engine.stats().num_requests_running == 1, 30)
            assert _engine_gauges(registry) == []
            child.kill()
            child.wait()
            assert await until(lambda: engine.stats().num_requests_running == 0 and _engine_gauges(registry), 3) < 3
    finally:
        child.kill()
        child.wait()
        dealer.close(linger=0)
        ctx.term()


async def test_a_host_whose_processor_thread_fails_detaches_from_the_core(core) -> None:
    """A host's processor thread that fails (an unexpected exception in it) while its process lives: its callers get
    `EngineDeadError`, and it says Goodbye, so the core aborts its requests at once (not run on to max_tokens) and
    hands the engine-wide metrics to a live host (the core's liveness check watches the process, which lives on)."""
    _, address = core
    registry = CollectorRegistry()
    async with AsyncEngine.connect(address, disable_log_stats=True) as failing:
        await failing.generate("hi", SamplingParams(max_tokens=1))  # attached first: it reports
        async with AsyncEngine.connect(address, disable_log_stats=True, prometheus_registry=registry) as live:
            await live.generate("hi", SamplingParams(max_tokens=1))
            stream = failing.stream("hello", SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
            await anext(stream)
            assert live.stats().num_requests_running == 1 and _engine_gauges(registry) == []

            def fail(*args) -> None:
                raise RuntimeError("injected")

            failing._replicas[0].processor._on_core_message = fail  # its next core message fails the thread
            with pytest.raises(EngineDeadError, match="processor thread failed: injected"):
                async for _ in stream:
                    pass
            deadline = time.monotonic() + 3
            while live.stats().num_requests_running or not _engine_gauges(registry):
                assert time.monotonic() < deadline, (live.stats(), _engine_gauges(registry))
                await asyncio.sleep(0.05)


def _probe_hello(folder: Path) -> bytes:
    """The first frame `AsyncEngine.connect`'s handshake sends, as a core at its address receives it."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, 10_000)
    address = f"ipc://{folder / 'probe.sock'}"
    router.bind(address)
    try:
        with pytest.raises(EngineDeadError, match="no engine core answered"):
            handshake(address, timeout_s=0.3)  # nothing answers: it says Hello, gives up, then says Goodbye
        return router.recv_multipart()[1]
    finally:
        router.close(linger=0)
        ctx.term()


async def test_a_probe_killed_before_its_goodbye_leaves_no_ghost_host(core, tmp_path: Path) -> None:
    """A host killed during `connect()`'s handshake (SIGKILL while the core loads) never says the probe's Goodbye:
    the probe must not stay a host of the core that holds the engine-wide metrics a live host should export."""
    _, address = core
    ctx = zmq.Context()
    ghost = open_dealer(ctx, address, None)
    registry = CollectorRegistry()

    try:
        ghost.send(_probe_hello(tmp_path))  # and no Goodbye after it
        assert ghost.poll(30_000) and isinstance(msgspec.msgpack.decode(ghost.recv(), type=protocol.CoreMessage),
                                                 protocol.Ready)
        async with AsyncEngine.connect(address, disable_log_stats=True, prometheus_registry=registry) as engine:
            await engine.generate("hi", SamplingParams(max_tokens=2))
            deadline = time.monotonic() + 5
            while not _engine_gauges(registry) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _engine_gauges(registry), "the live host exports no engine-wide gauges"
        assert not ghost.poll(200)  # no outputs for a probe
    finally:
        ghost.close(linger=0)
        ctx.term()


async def test_sigterm_stops_the_core_cleanly_and_an_attached_host_survives_its_restart(core, tiny_llama: str) -> None:
    """A planned restart of the shared core (SIGTERM, then started again): a host with max_core_restarts waits
    for the new core (its socket is gone meanwhile) and serves again."""
    proc, address = core
    async with AsyncEngine.connect(address, disable_log_stats=True, max_core_restarts=1) as engine:
        greedy = SamplingParams(temperature=0, max_tokens=8)
        before = (await engine.generate("def main():", greedy)).token_ids
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, stderr[-2000:]
        assert "stopping the engine core" in stderr
        assert not os.path.exists(address[len("ipc://"):])  # the socket is removed
        await asyncio.sleep(0.5)  # the host noticed; its restart waits for a socket
        new_proc, _ = await asyncio.to_thread(_start_core, tiny_llama, Path(address[len("ipc://"):]).parent.parent,
                                              *CORE_FLAGS)  # the same engine again (another one ends the host)
        try:
            assert (await asyncio.wait_for(engine.generate("def main():", greedy), 60)).token_ids == before
            assert engine.stats().engine_alive
        finally:
            new_proc.kill()
            new_proc.wait()


async def test_connect_refuses_tcp_and_bad_addresses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCLLM_ENGINE_KEY", raising=False)
    with pytest.raises(ConfigError, match="ASYNCLLM_ENGINE_KEY"):  # tcp:// needs the shared secret (tests/unit/test_auth.py)
        AsyncEngine.connect("tcp://127.0.0.1:5555")
    with pytest.raises(ConfigError, match="address"):
        AsyncEngine.connect("/tmp/sock")
    engine = AsyncEngine.connect(f"ipc://{tmp_path / 'nobody.sock'}")
    with pytest.raises(EngineDeadError, match="no engine core listens"):
        await engine.start()


async def test_a_killed_core_fails_an_attached_hosts_streams_at_once(tiny_llama: str, tmp_path_factory) -> None:
    """A host attached over ipc:// has no heartbeat and no process to watch: the kernel closing the dead core's socket
    is what tells it. A SIGKILLed core (no last word) fails the host's open stream within seconds, naming the
    address; closing the host then ends its supervisor's wait for a new core at once (the dead core's socket file
    is left behind: the restart's handshake waits on it)."""
    proc, address = _start_core(tiny_llama, tmp_path_factory.mktemp("killed"))
    try:
        async with AsyncEngine.connect(address, disable_log_stats=True, max_core_restarts=1) as engine:
            stream = engine.stream("def main():", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            with pytest.raises(EngineDeadError, match="connection to the engine core closed") as failed:
                async for _ in stream:
                    if proc.poll() is None:
                        proc.kill()
                        killed = time.monotonic()
            await asyncio.sleep(1)  # its supervisor's restart now waits on the stale socket; the close ends the wait
        assert time.monotonic() - killed < 5 and address in str(failed.value)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
