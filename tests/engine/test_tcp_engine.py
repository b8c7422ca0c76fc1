"""A standalone core on a tcp:// address: hosts with the shared secret are served, others are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from asyncllm import AsyncEngine, EngineDeadError, SamplingParams
from asyncllm.engine.connect import handshake
from asyncllm.procutil import free_tcp_port
from hf_reference import hf_greedy

KEY = "tcp-test-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def tcp_core(tiny_llama: str):
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    env = {**os.environ, "ASYNCLLM_ENGINE_KEY": KEY}
    command = [sys.executable, "-P", "-m", "asyncllm", "engine", tiny_llama, "--address", address,
               "--disable-log-stats", "--max-model-len", "auto", "--num-gpu-blocks-override", "8"]  # auto: 8 x 16
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            handshake(address, timeout_s=2.0, key=KEY)  # returns once the model is loaded
            break
        except EngineDeadError:
            assert time.monotonic() < deadline, "the tcp core did not start"
    yield address, proc
    proc.terminate()
    proc.wait(timeout=30)


async def test_the_right_key_is_served_exactly(tcp_core, tiny_llama: str) -> None:
    address, _ = tcp_core
    async with AsyncEngine.connect(address, key=KEY, disable_log_stats=True) as engine:
        assert engine.config.max_model_len == 128  # the shared core's, fitted to its 8 blocks of 16
        out = await engine.generate("def main():", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert out.token_ids == hf_greedy(tiny_llama, tokenizer("def main():").input_ids, 8)


async def test_a_wrong_key_is_refused_at_once_and_the_core_keeps_serving(tcp_core) -> None:
    address, proc = tcp_core
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="ASYNCLLM_ENGINE_KEY"):
        await AsyncEngine.connect(address, key="not-the-core-secret-at-all", disable_log_stats=True).start()
    assert time.monotonic() - started < 5.0  # the failed handshake says so; no startup timeout
    assert proc.poll() is None
    assert handshake(address, timeout_s=10.0, key=KEY).max_model_len == 128
