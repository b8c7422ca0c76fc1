"""One standalone engine core (`asyncllm engine`) shared by two host processes (`AsyncEngine.connect`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncllm import AsyncEngine, ConfigError, EngineDeadError, SamplingParams
from asyncllm.engine.connect import handshake
from hf_reference import hf_greedy

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


def _start_core(model: str, folder: Path) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{folder / 'run' / 'engine.sock'}"
    proc = _python("-m", "asyncllm", "engine", model, "--address", address, "--disable-log-stats",
                   stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(address[len("ipc://"):]):
        assert proc.poll() is None and time.monotonic() < deadline, "the standalone core did not start"
        time.sleep(0.05)
    handshake(address, timeout_s=120)  # returns once the model is loaded
    return proc, address


@pytest.fixture(scope="module")
def core(tiny_llama: str, tmp_path_factory):
    proc, address = _start_core(tiny_llama, tmp_path_factory.mktemp("core"))
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
    assert handshake(address, timeout_s=10).model == tiny_llama


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
            AsyncEngine.connect(address, disable_log_stats=True) as b:
        assert await asyncio.gather(collect(a.stream(PROMPTS[0], greedy(40), request_id="same")),
                                    collect(b.stream(PROMPTS[1], greedy(40), request_id="same"))) \
            == [expected[0], expected[1][:40]]
        b_stream = b.stream(PROMPTS[1], greedy(200), request_id="again")
        b_ids = (await anext(b_stream)).token_ids
        async for _ in a.stream(PROMPTS[0], greedy(40), request_id="again"):
            break  # a aborts its "again" one token in, long before b's 200 tokens
        b_ids += await asyncio.wait_for(collect(b_stream), 120)  # had a's abort ended b's request, b would wait
        assert b_ids == expected[1]


def test_sigterm_stops_the_core_cleanly(core) -> None:
    proc, address = core
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert "stopping the engine core" in stderr
    assert not os.path.exists(address[len("ipc://"):])  # the socket is removed


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
    address."""
    proc, address = _start_core(tiny_llama, tmp_path_factory.mktemp("killed"))
    try:
        async with AsyncEngine.connect(address, disable_log_stats=True) as engine:
            stream = engine.stream("def main():", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            with pytest.raises(EngineDeadError, match="connection to the engine core closed") as failed:
                async for _ in stream:
                    if proc.poll() is None:
                        proc.kill()
                        killed = time.monotonic()
        assert time.monotonic() - killed < 5 and address in str(failed.value)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
