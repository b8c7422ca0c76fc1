"""max_model_len auto (-1) across the replicas and core restarts: the host side, with the cores faked."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncllm import AsyncEngine
from asyncllm.engine import async_engine
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.data_parallel import served_max_model_len


def _serve(replica, max_model_len: int) -> None:
    """What `start_replica` leaves: a processor enforcing its core's Ready, and the replica knowing the value."""
    prompts = PromptTokenizer(None, 10)
    prompts.ready(max_model_len)
    replica.processor, replica.max_model_len = SimpleNamespace(_prompts=prompts, dead=None), max_model_len


def _restart(monkeypatch, engine: AsyncEngine, index: int, fitted: int) -> list[int]:
    """`engine._restart_replica(index)` with a fake core that fits `fitted` (served as is when a value is set);
    returns the max_model_len each start was asked for."""
    asked: list[int] = []

    async def start_replica(replica, config, spec, closed=None):
        asked.append(config.max_model_len)
        _serve(replica, fitted if config.max_model_len == -1 else config.max_model_len)

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


def test_an_attached_host_restarts_with_its_cores_length_not_auto(monkeypatch) -> None:
    """A shared core's restart must serve what it served (`_check_same_core`): the host never asks for -1."""
    engine = AsyncEngine.connect("ipc:///tmp/asyncllm-no-core.sock", max_model_len=-1)
    _serve(engine._replicas[0], 96)
    engine.config = engine.config.replace(max_model_len=96)  # the core's, from its Ready
    assert _restart(monkeypatch, engine, 0, fitted=64) == [96]
    assert engine.config.max_model_len == 96


def test_a_longrope_fit_within_the_original_length_warns(caplog) -> None:
    """The workers keep the long factors of the model's maximum: a fit of at most `original` tokens, where
    transformers would use the short ones, is warned about with the explicit max_model_len to set."""
    import json
    import logging

    from asyncllm import EngineConfig
    from asyncllm.engine.kv_budget import served_config

    rope = {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0],
            "long_factor": [2.0]}
    config = EngineConfig.create("m", max_model_len=2048, block_size=16)
    for blocks, rope_parameters, warned in ((4, rope, True), (5, rope, False), (4, {"rope_type": "default"}, False)):
        caplog.clear()
        hf_config_json = json.dumps({"max_position_embeddings": 2048, "rope_parameters": rope_parameters})
        with caplog.at_level(logging.WARNING, logger="asyncllm.engine.core"):
            assert served_config(config, blocks, True, hf_config_json).max_model_len == blocks * 16
        assert any("set max_model_len to at most 64" in r.getMessage() for r in caplog.records) == warned
