"""Fuzzing a real engine: malformed prompts and parameters through the public API, and raw frames on the core's socket.

Whatever comes in, only typed errors come out (`InvalidRequestError`,
`EngineOverloadedError`), the engine still serves a normal request exactly
afterwards, and no KV block stays in use. The engine runs on its own event
loop in a thread, so that hypothesis drives plain synchronous tests.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from asyncllm import (AsyncEngine, EngineOverloadedError, InvalidRequestError, PoolingParams, SamplingParams,
                      StructuredOutputs, protocol)
from hf_reference import hf_greedy
from proc_utils import worker_pids
from engine_helpers import wait_idle as _wait_idle

VOCAB = 512  # asyncllm's tiny Llama
MAX_MODEL_LEN = 64
TYPED = (InvalidRequestError, EngineOverloadedError)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])


class EngineThread:
    """An AsyncEngine on its own loop in a thread; `call` runs a coroutine there and returns its result."""

    def __init__(self, model: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-engine-loop", daemon=True)
        self.thread.start()
        self.engine = AsyncEngine(model, disable_log_stats=True, max_model_len=MAX_MODEL_LEN,
                                  num_gpu_blocks_override=64, max_num_seqs=16)
        self.call(self.engine.start())
        self.workers = worker_pids(self.engine._core.pid)
        """A worker restart during the fuzz would mean some input crashed a worker: the same pids must serve."""

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.engine.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def engine_thread(tiny_llama: str) -> Iterator[EngineThread]:
    runner = EngineThread(tiny_llama)
    yield runner
    runner.close()


# ---------------------------------------------------------------- strategies
ANY_CHAR = st.characters(codec=None, exclude_categories=())  # lone surrogates included
ANY_TEXT = st.text(ANY_CHAR, max_size=12)
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), ANY_TEXT, st.binary(max_size=6),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _or_junk(good: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(good, good, JUNK)


_PARAM_FIELDS = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(-1, 60),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**63 - 1), "max_tokens": st.integers(1, 6),
    "min_tokens": st.integers(0, 3), "stop": st.lists(ANY_TEXT, max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, VOCAB + 50), max_size=3), "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(0, 3), "logprobs": st.integers(0, 25), "prompt_logprobs": st.integers(0, 25),
    "logit_bias": st.dictionaries(st.integers(-2, VOCAB + 50), st.floats(-150, 150), max_size=3),
    "output_kind": st.sampled_from(["delta", "cumulative", "final_only", 0, 1, 2]),
}
PARAMS = st.one_of(  # in-range values only (every path to the workers), or a few fields of junk
    st.fixed_dictionaries({}, optional=_PARAM_FIELDS),
    st.fixed_dictionaries({}, optional={name: _or_junk(good) for name, good in _PARAM_FIELDS.items()}),
)
_GOOD_PROMPTS = st.one_of(st.text(max_size=40, min_size=1),
                          st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
PROMPTS = st.one_of(
    _GOOD_PROMPTS, _GOOD_PROMPTS, _GOOD_PROMPTS, _GOOD_PROMPTS,
    st.text(ANY_CHAR, max_size=40), st.lists(st.integers(-3, VOCAB + 50), max_size=MAX_MODEL_LEN + 5),
    st.lists(JUNK, max_size=3), JUNK, st.dictionaries(st.text(max_size=6), JUNK, max_size=2),
)
_ROLES = st.sampled_from(["user", "assistant", "system"])
_GOOD_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30)}),
                          min_size=1, max_size=2)
MESSAGES = st.one_of(
    _GOOD_MESSAGES, _GOOD_MESSAGES, _GOOD_MESSAGES,
    st.lists(st.fixed_dictionaries({"role": _ROLES, "content": st.text(max_size=30)}), min_size=1, max_size=3),
    st.lists(st.fixed_dictionaries({"role": _or_junk(_ROLES), "content": _or_junk(st.text(ANY_CHAR, max_size=30))}),
             max_size=3),
    st.lists(JUNK, max_size=2), JUNK,
)
OPTIONS = st.fixed_dictionaries({}, optional={  # a request_id may repeat one in flight: refused, typed
    "priority": _or_junk(st.integers(-5, 5)), "request_id": _or_junk(st.text(ANY_CHAR, min_size=1, max_size=8)),
    "timeout": _or_junk(st.floats(0.001, 5)), "cache_salt": _or_junk(ANY_TEXT),
})


def _assert_still_serves(runner: EngineThread, model: str) -> None:
    assert worker_pids(runner.engine._core.pid) == runner.workers  # no input crashed a worker (no restart)
    runner.call(_wait_idle(runner.engine))
    assert runner.engine.stats().engine_alive and runner.engine.stats().num_used_blocks == 0
    prompt = "def main():"
    out = runner.call(runner.engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert out.token_ids == hf_greedy(model, tokenizer(prompt).input_ids, 8)


# ---------------------------------------------------------------- the public API
@FUZZ
@given(prompt=PROMPTS, messages=MESSAGES, kwargs=PARAMS, options=OPTIONS, chat=st.sampled_from([False, False, True]))
def test_public_api_fuzz_raises_only_typed_errors(engine_thread: EngineThread, prompt: Any, messages: Any,
                                                  kwargs: dict, options: dict, chat: bool) -> None:
    engine = engine_thread.engine
    params = SamplingParams(**kwargs)

    async def one() -> None:
        if chat:
            stream = engine.chat(messages, params, **options)
            async with stream:
                async for _ in stream:
                    pass
        else:
            out = await engine.generate(prompt, params, **options)
            assert len(out.outputs) == params.n
            assert all(len(o.token_ids) <= params.max_tokens for o in out.outputs if params.max_tokens)

    try:
        engine_thread.call(one())
    except TYPED as exc:
        event(f"refused: {getattr(exc, 'field', type(exc).__name__)}")
    else:
        event("served")


def test_public_api_after_fuzz_serves_exactly(engine_thread: EngineThread, tiny_llama: str) -> None:
    _assert_still_serves(engine_thread, tiny_llama)


# ---------------------------------------------------------------- raw frames on the core's socket
FLOATS = st.floats()  # NaN and infinities included
WIRE_INTS = st.integers(-2**63, 2**64 - 1)


def _one_field_off(valid: st.SearchStrategy, bad: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """`valid` objects, half of them with one field replaced by a value from `bad` (each check reached alone)."""
    def spoil(obj: Any) -> st.SearchStrategy:
        return st.sampled_from(sorted(bad)).flatmap(
            lambda name: bad[name].map(lambda value: msgspec.structs.replace(obj, **{name: value})))
    return st.one_of(valid, valid.flatmap(spoil))


WIRE_PARAMS = _one_field_off(
    st.builds(SamplingParams, temperature=st.floats(0, 2), top_k=st.integers(-1, 50), max_tokens=st.integers(1, 8),
              min_tokens=st.integers(0, 4), seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
              stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2), repetition_penalty=st.floats(0.5, 2),
              logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100),
                                                              max_size=2)),
              logprobs=st.one_of(st.none(), st.integers(0, 20)),
              prompt_logprobs=st.one_of(st.none(), st.integers(0, 20))),
    {"n": WIRE_INTS, "temperature": FLOATS, "top_p": FLOATS, "top_k": WIRE_INTS, "min_p": FLOATS,
     "max_tokens": WIRE_INTS, "min_tokens": WIRE_INTS, "seed": WIRE_INTS,
     "stop_token_ids": st.lists(WIRE_INTS, max_size=3),
     "repetition_penalty": FLOATS, "presence_penalty": FLOATS, "frequency_penalty": FLOATS,
     "logit_bias": st.dictionaries(WIRE_INTS, FLOATS, max_size=2), "logprobs": WIRE_INTS, "prompt_logprobs": WIRE_INTS},
)
ADD_REQUESTS = _one_field_off(
    st.builds(protocol.AddRequest, request_id=st.uuids().map(str),
              prompt_token_ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), params=WIRE_PARAMS,
              eos_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2), arrival_time=st.floats(0, 2e9),
              priority=st.integers(-5, 5), cache_salt=st.one_of(st.none(), st.text(max_size=4)),
              timeout=st.one_of(st.none(), st.floats(0.01, 10))),
    {"request_id": st.text(max_size=1100), "prompt_token_ids": st.lists(WIRE_INTS, max_size=MAX_MODEL_LEN + 2),
     "eos_token_ids": st.lists(WIRE_INTS, max_size=2), "arrival_time": FLOATS, "priority": WIRE_INTS,
     "timeout": FLOATS},
)
WIRE_JUNK = st.recursive(st.one_of(st.none(), st.booleans(), WIRE_INTS, FLOATS, st.text(max_size=6),
                                   st.binary(max_size=6)),
                         lambda inner: st.lists(inner, max_size=4), max_leaves=12)
FRAMES = st.one_of(
    st.binary(max_size=64).map(lambda b: [b]),
    st.lists(st.binary(max_size=16), min_size=2, max_size=3),
    *[ADD_REQUESTS.map(lambda m: [msgspec.msgpack.encode(m)])] * 4,
    st.lists(WIRE_JUNK, max_size=9).map(lambda items: [msgspec.msgpack.encode(["AddRequest", *items])]),
    st.lists(st.one_of(st.text(max_size=8), WIRE_JUNK), max_size=3).map(
        lambda ids: [msgspec.msgpack.encode(["AbortRequests", ids])]),
)


class RawHost:
    """A DEALER that speaks the wire protocol by hand, and remembers every reply."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 1000)
        self.dealer.connect(address)
        self.decoder = msgspec.msgpack.Decoder(protocol.CoreMessage)
        self.replies: list[protocol.CoreMessage] = []

    def send(self, message: protocol.HostMessage) -> None:
        self.dealer.send(msgspec.msgpack.encode(message))

    def drain(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while self.dealer.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            self.replies.append(self.decoder.decode(self.dealer.recv()))

    def close(self) -> None:
        self.dealer.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def raw_host(engine_thread: EngineThread) -> Iterator[RawHost]:
    host = RawHost(engine_thread.engine._core.address)
    host.send(protocol.Hello(pid=os.getpid(), wire_protocol=protocol.wire_protocol()))
    host.drain(2.0)
    assert any(isinstance(r, protocol.Ready) for r in host.replies)
    yield host
    host.close()


def test_frames_from_a_host_that_never_said_hello_are_dropped(engine_thread: EngineThread) -> None:
    """Never run; an AddRequest is answered with an error so that its caller does not wait (core.py `_handle`)."""
    stranger = RawHost(engine_thread.engine._core.address)
    try:
        stranger.send(protocol.AddRequest("stranger", [1, 2, 3], SamplingParams(max_tokens=4), [], time.time()))
        stranger.send(protocol.ResetPrefixCache())
        stranger.drain(0.5)
        assert [(d.request_id, d.finish_reason, d.error_type) for r in stranger.replies for d in r.outputs] == [
            ("stranger", "abort", "EngineDeadError")]
        assert engine_thread.engine.stats().num_requests_running == 0
    finally:
        stranger.close()


def _finished(host: RawHost, request_id: str, timeout: float = 30.0,
              served: bool = False) -> list[protocol.RequestOutputDelta]:
    """Drain `host` until a delta finishes `request_id` (`served`: one without an error); all of that id's deltas
    (plain tokens included)."""
    deadline = time.monotonic() + timeout
    while True:
        deltas = [d for r in host.replies if isinstance(r, protocol.Outputs)
                  for d in [*r.outputs, *(protocol.RequestOutputDelta(i, [t]) for i, t in zip(r.token_req_ids,
                                                                                                r.token_ids))]
                  if d.request_id == request_id]
        if any(d.finish_reason and not (served and d.error) for d in deltas) or time.monotonic() > deadline:
            return deltas
        host.drain(0.05)


@pytest.fixture()
def own_host(engine_thread: EngineThread) -> Iterator[RawHost]:
    host = RawHost(engine_thread.engine._core.address)
    host.send(protocol.Hello(pid=os.getpid(), wire_protocol=protocol.wire_protocol()))
    yield host
    host.send(protocol.Goodbye(shutdown=False))
    host.close()


def test_what_would_end_the_core_or_its_workers_is_refused_alone(engine_thread: EngineThread,
                                                                 own_host: RawHost) -> None:
    """A frame nested deeper than Python's recursion limit (it ended the core's I/O thread), and a classification
    on a model without a score head (it ended the workers, then the engine): the core serves on."""
    deep = msgspec.msgpack.encode(protocol.AddRequest("deep", [1, 2], SamplingParams(max_tokens=2, structured=(
        StructuredOutputs(json={"a": "MARK"}))), [], time.time()))
    own_host.dealer.send(deep.replace(b"\xa4MARK", b"\x91" * 5000 + b"\x90"))
    own_host.send(protocol.AddRequest("classify", [1, 2], SamplingParams(max_tokens=1), [], time.time(),
                                      pooling=PoolingParams(task="classify")))
    [refused] = _finished(own_host, "classify")
    assert (refused.error_type, refused.finish_reason) == ("InvalidRequestError", "abort")
    assert refused.error.startswith("model: this model serves embed and generate requests only")
    own_host.send(protocol.AddRequest("after", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), [], time.time()))
    after = _finished(own_host, "after")
    assert [t for d in after for t in d.new_token_ids] and after[-1].finish_reason == "length"
    assert _finished(own_host, "deep", timeout=0) == []  # dropped, not decoded
    assert worker_pids(engine_thread.engine._core.pid) == engine_thread.workers


def test_a_structured_request_id_in_use_is_refused_before_its_grammar_replaces_the_running_ones(
        own_host: RawHost) -> None:
    pytest.importorskip("xgrammar")
    params = SamplingParams(temperature=0.0, max_tokens=50, structured=StructuredOutputs(regex="(ab){20}"))
    own_host.send(protocol.AddRequest("twice", [1, 2, 3], params, [], time.time()))
    deadline = time.monotonic() + 60
    while not any(isinstance(r, protocol.Outputs) and r.outputs for r in own_host.replies):  # it runs
        assert time.monotonic() < deadline
        own_host.drain(0.01)
    own_host.send(protocol.AddRequest("twice", [1, 2, 3], params, [], time.time()))
    deltas = _finished(own_host, "twice", served=True)
    assert [d.error.split(":")[0] for d in deltas if d.error] == ["request_id"]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].error is None  # its grammar ended it, not max_tokens


@FUZZ
@given(frames=FRAMES)
def test_raw_frame_fuzz_never_kills_the_core(engine_thread: EngineThread, raw_host: RawHost,
                                             frames: list[bytes]) -> None:
    raw_host.dealer.send_multipart(frames)
    raw_host.drain(0.0)
    assert engine_thread.engine._core.death() is None


def test_raw_frames_got_only_typed_errors_and_the_core_serves(engine_thread: EngineThread, raw_host: RawHost,
                                                              tiny_llama: str) -> None:
    raw_host.send(protocol.Goodbye(shutdown=False))  # abort whatever valid fuzz requests still run
    raw_host.drain(1.0)
    assert not any(isinstance(r, protocol.EngineFailed) for r in raw_host.replies)
    deltas = [d for r in raw_host.replies if isinstance(r, protocol.Outputs) for d in r.outputs]
    errors = [d for d in deltas if d.error is not None]
    assert errors, "the fuzz should have produced refused requests"
    assert {d.error_type for d in errors} <= {"InvalidRequestError", "EngineOverloadedError"}
    assert all(d.finish_reason == "abort" for d in errors)
    assert all(not (isinstance(t, float) and math.isnan(t)) for d in deltas for t in d.new_token_ids)
    _assert_still_serves(engine_thread, tiny_llama)
