"""max_model_len auto (-1) across the replicas and core restarts: the host side, with the cores faked."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec

from asyncllm import AsyncEngine, SamplingParams, protocol
from asyncllm.engine import async_engine
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.data_parallel import served_max_model_len
from asyncllm.engine.stream import RequestOptions
from asyncllm.sched.request import Request


def _serve(replica, max_model_len: int) -> None:
    """What `start_replica` leaves: a processor enforcing its core's Ready, and the replica knowing the value."""
    prompts = PromptTokenizer(None, 10)
    prompts.ready(max_model_len)
    processor = SimpleNamespace(_prompts=prompts, serve_max_model_len=prompts.serve, dead=None)  # its thread's job
    replica.processor, replica.max_model_len = processor, max_model_len


def _restart(monkeypatch, engine: AsyncEngine, index: int, fitted: int) -> list[int]:
    """`engine._restart_replica(index)` with a fake core that fits `fitted` (served as is when a value is set);
    returns the max_model_len each start was asked for."""
    asked: list[int] = []

    async def start_replica(replica, config, spec, closed=None):
        asked.append(config.max_model_len)
        served = fitted if config.max_model_len == -1 else config.max_model_len
        _serve(replica, served)
        return SimpleNamespace(config=config.replace(max_model_len=served))  # `Prepared`: a shared core's config

    async def nothing(*args) -> None:
        return None

    monkeypatch.setattr(async_engine, "start_replica", start_replica)
    monkeypatch.setattr(async_engine, "finish_in_thread", nothing)
    asyncio.run(engine._restart_replica(index))
    return asked


def _processors_limit(engine: AsyncEngine) -> list[int]:
    return [replica.processor._prompts.max_model_len for replica in engine._replicas]


def test_data_parallel_replicas_serve_the_least_fitted_length() -> None:
    """vLLM fits one max_model_len for its data-parallel engines: the least; every processor enforces it."""
    engine = AsyncEngine("m", max_model_len=-1, data_parallel_size=3)
    for replica, fitted in zip(engine._replicas, (128, 96, 112)):
        _serve(replica, fitted)
    config = served_max_model_len(engine._replicas.replicas, engine.config)
    assert config.max_model_len == 96
    assert _processors_limit(engine) == [96, 96, 96]


def test_a_restarted_owned_core_fits_again_and_the_engine_shows_it(monkeypatch) -> None:
    engine = AsyncEngine("m", max_model_len=-1, data_parallel_size=2)
    for replica in engine._replicas:
        _serve(replica, 128)
    engine.config = engine.config.replace(max_model_len=128)  # the first fit, as `start` sets it
    assert _restart(monkeypatch, engine, 1, fitted=96) == [-1]  # fitted again
    assert engine.config.max_model_len == 96  # the restarted core's fit, the least now
    assert _processors_limit(engine) == [96, 96]
    assert engine._replicas[0].max_model_len == 128  # its own core's, should the other one fit more again
    assert _restart(monkeypatch, engine, 1, fitted=112) == [-1]
    assert (engine.config.max_model_len, _processors_limit(engine)) == (112, [112, 112])


def test_a_new_least_reaches_the_processors_told_an_older_one(monkeypatch) -> None:
    """Replicas fitted 100, 200, 200 serve 100; the 100 one restarts fitting 300: the others serve 200 again."""
    engine = AsyncEngine("m", max_model_len=-1, data_parallel_size=3)
    for replica, fitted in zip(engine._replicas, (100, 200, 200)):
        _serve(replica, fitted)
    engine.config = served_max_model_len(engine._replicas.replicas, engine.config)
    assert _processors_limit(engine) == [100, 100, 100]
    assert _restart(monkeypatch, engine, 0, fitted=300) == [-1]
    assert (engine.config.max_model_len, _processors_limit(engine)) == (200, [200, 200, 200])


def _run_to_end(params: SamplingParams, prompt: list[int], max_model_len: int) -> tuple[int, str | None]:
    """A core's request (its params through the wire, as the core decodes them) fed token 7 until it stops at
    `max_model_len`: its output tokens and finish_reason."""
    message = protocol.AddRequest("r", prompt, params, [2], 0.0)
    message = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=protocol.AddRequest)
    request = Request.from_add_request(message, b"")
    while not request.is_finished:
        request.append_output_token(7)
        request.check_stop(max_model_len)
    return request.num_output_tokens, request.finish_reason


def test_a_longer_core_ends_every_sequence_at_the_served_length() -> None:
    """A replica whose core fitted 32 tokens serving the replicas' least, 16: its processor cuts max_tokens (and
    min_tokens, which may not exceed it) to the room the served length leaves, so the sequence ends as on a core
    of 16 tokens, by length; a request ending sooner, an echo filling the length, or a core serving its own
    length keep their params."""
    prompts = PromptTokenizer(None, 10)
    prompts.ready(32)
    prompts.serve(16)
    assert (prompts.max_model_len, prompts.core_max_model_len) == (16, 32)
    prompt = [1] * 10
    for params in (SamplingParams(max_tokens=None), SamplingParams(max_tokens=100, min_tokens=50),
                   SamplingParams(min_tokens=4)):  # the default max_tokens (16) too
        job = SimpleNamespace(prompt=prompt, params=params, options=RequestOptions(), chat=False)
        assert prompts.token_ids(job) == prompt
        assert (job.params.max_tokens, job.params.min_tokens) == (6, min(params.min_tokens, 6))
        assert _run_to_end(job.params, prompt, 32) == _run_to_end(params, prompt, 16) == (6, "length")
    kept = SamplingParams(max_tokens=3, min_tokens=1)
    job = SimpleNamespace(prompt=prompt, params=kept, options=RequestOptions(), chat=False)
    prompts.token_ids(job)
    assert job.params is kept
    echo = SimpleNamespace(prompt=[1] * 16, params=SamplingParams(max_tokens=1), options=RequestOptions(echo_only=True),
                           chat=False)
    prompts.token_ids(echo)
    assert echo.params.max_tokens == 1
    prompts.serve(64)  # never past the core's own: it serves 32 again, and stops sequences there itself
    job = SimpleNamespace(prompt=prompt, params=SamplingParams(max_tokens=None), options=RequestOptions(), chat=False)
    prompts.token_ids(job)
    assert (prompts.max_model_len, job.params.max_tokens) == (32, None)


def test_the_processor_thread_serves_the_length_in_order_with_requests() -> None:
    """`Processor.serve_max_model_len` is a job of the processor thread: requests submitted after it see it."""
    from asyncllm.engine.processor import Processor

    processor = Processor(address="ipc:///tmp/asyncllm-no-core.sock", tokenizer=None, eos_token_ids=[2], vocab_size=10,
                          deliver=lambda batch, stats: None, core=None, stats_logger=None, startup_timeout_s=1)
    try:
        processor._prompts.ready(32)  # its core's Ready
        processor.serve_max_model_len(16)
        assert processor._prompts.max_model_len == 32  # not before the thread reaches the job
        assert processor._handle_jobs(None)  # what the thread does when the doorbell rings
        assert processor._prompts.max_model_len == 16
    finally:
        processor._doorbell_pull.close(linger=0)  # the thread's to close, never started here
        processor.close(shutdown_core=False)


def test_an_attached_host_restarts_with_its_cores_length_not_auto(monkeypatch) -> None:
    """The host never asks a shared core for -1: the core fits its own (the host takes it, `_check_same_core`)."""
    engine = AsyncEngine.connect("ipc:///tmp/asyncllm-no-core.sock")
    _serve(engine._replicas[0], 96)
    engine.config = engine.config.replace(max_model_len=96)  # the core's, from its Ready
    assert _restart(monkeypatch, engine, 0, fitted=64) == [96]
    assert engine.config.max_model_len == 96


def test_a_longrope_model_defaults_to_its_original_length() -> None:
    """vLLM's default for LongRoPE (max_model_len None or -1): original_max_position_embeddings, in the rope
    parameters (any layer type's) or the config, so its workers take the short factors transformers uses there;
    -1 then only lowers it. An explicit longer value keeps the long factors; other ropes keep the model's maximum."""
    from types import SimpleNamespace

    from asyncllm import EngineConfig
    from asyncllm.engine.kv_budget import served_config
    from asyncllm.engine.prepare import _max_model_len

    rope = {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0],
            "long_factor": [2.0]}
    legacy = {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}
    configs = [SimpleNamespace(max_position_embeddings=2048, rope_parameters=rope),
               SimpleNamespace(max_position_embeddings=2048, rope_parameters={"full_attention": rope}),
               SimpleNamespace(max_position_embeddings=2048, rope_scaling=legacy, original_max_position_embeddings=64)]
    for hf_config in configs:
        for given in (None, -1):
            assert _max_model_len(EngineConfig.create("m", max_model_len=given), hf_config) == 64
        assert _max_model_len(EngineConfig.create("m", max_model_len=1000), hf_config) == 1000
    default = SimpleNamespace(max_position_embeddings=2048, rope_parameters={"rope_type": "default"})
    assert _max_model_len(EngineConfig.create("m"), default) == 2048
    fitted = EngineConfig.create("m", max_model_len=64, block_size=16)  # -1 as the host resolved it
    assert served_config(fitted, 3, True).max_model_len == 48 and served_config(fitted, 8, True).max_model_len == 64
