"""A host attached to a shared core (`AsyncEngine.connect`) takes the core's config, sent in its `Ready`: core-side
fields are the core's, host-side ones (`config.HOST_SIDE_FIELDS`) the host's own when given, else the core's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from asyncllm import AsyncEngine, ConfigError, EngineDeadError, protocol
from asyncllm.attention import availability
from asyncllm.config import HOST_SIDE_FIELDS, EngineConfig
from asyncllm.engine import async_engine, connect
from asyncllm.engine.prepare import prepare

CORE_FIELDS = dict(max_logprobs=50, override_generation_config={"max_tokens": 3, "temperature": 0.0},
                   logprobs_mode="raw_logits", block_size=8, enable_prefix_caching=False, tokenizer_mode="hf",
                   hf_overrides={"max_position_embeddings": 96}, limit_mm_per_prompt={"image": 0},
                   stream_interval=4, log_stats_interval=3.0)


def _ready(config: EngineConfig) -> protocol.Ready:
    """The `Ready` a core serving `config` sends, through msgpack as on the wire."""
    ready = protocol.Ready(64, config.block_size, config.max_model_len or 0, 1, wire_protocol=protocol.wire_protocol(),
                           config=config.to_dict(wire=True))
    return msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=protocol.CoreMessage)


def test_an_attached_host_takes_the_cores_config_with_its_own_host_side_fields(tiny_llama, monkeypatch) -> None:
    core = prepare(EngineConfig.create(tiny_llama, **CORE_FIELDS)).config  # what the core's Ready holds
    monkeypatch.setattr(connect, "_handshake_now", lambda *args: _ready(core))
    placeholder = EngineConfig.create("ipc:///core.sock", stream_interval=2)
    attached = connect.prepare_attached(placeholder, "ipc:///core.sock", 1.0, host_fields={"stream_interval": 2})
    host, served = attached.config.to_dict(), core.to_dict()
    assert {name for name in served if host[name] != served[name]} == {"stream_interval"}
    assert (host["stream_interval"], host["log_stats_interval"], host["max_model_len"]) == (2, 3.0, 96)
    assert attached.default_sampling == {"max_tokens": 3, "temperature": 0.0}  # the core's generation defaults


def test_an_attached_host_need_not_have_the_cores_attention_package(tiny_llama, monkeypatch) -> None:
    """The core checked its attention backend's package on its machine; the host runs no attention."""
    monkeypatch.setattr(availability, "package_installed", lambda package: True)
    core = prepare(EngineConfig.create(tiny_llama, attention_backend="triton")).config
    monkeypatch.setattr(availability, "package_installed", lambda package: False)
    monkeypatch.setattr(connect, "_handshake_now", lambda *args: _ready(core))
    attached = connect.prepare_attached(EngineConfig.create("ipc:///core.sock"), "ipc:///core.sock", 1.0)
    assert attached.config.attention_backend == "triton"
    with pytest.raises(ConfigError, match="pip install triton"):  # an owned core's config is still checked here
        EngineConfig.create(tiny_llama, attention_backend="triton")


def test_connect_refuses_core_side_fields_by_name_and_takes_host_side_ones(tmp_path) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    with pytest.raises(ConfigError) as refused:
        AsyncEngine.connect(address, enable_prefix_caching=False, logprobs_mode="raw_logits", stream_interval=2)
    message = str(refused.value)
    assert message.startswith("enable_prefix_caching=False, logprobs_mode='raw_logits' is not allowed: core-side")
    assert "`asyncllm engine`" in message and "may set only disable_log_stats, log_stats_interval" in message
    with pytest.raises(ConfigError, match="^data_parallel_size=2 is not allowed: core-side"):
        AsyncEngine.connect(address, data_parallel_size=2)
    with pytest.raises(ConfigError, match="a known EngineConfig field"):
        AsyncEngine.connect(address, no_such_field=1)
    host = dict(disable_log_stats=True, log_stats_interval=2.0, stream_interval=3, max_core_restarts=1,
                mm_processor_cache_type="shm", mm_processor_cache_gb=0.5, prometheus_registry=None)
    assert set(host) == HOST_SIDE_FIELDS
    engine = AsyncEngine.connect(address, **host)
    assert engine._launch_spec().host_fields == host


def test_a_restarted_shared_core_with_other_core_side_fields_is_refused(monkeypatch) -> None:
    """A host re-attaching after a core restart keeps its tokenizer, templates, generation defaults and served names:
    a core that now serves another config (but for host-side fields) ends it with an error naming what changed."""
    attached = EngineConfig.create("first-model", max_model_len=128, stream_interval=2)
    restarted = {"config": attached.replace(model="other-model", max_logprobs=5, stream_interval=7)}
    monkeypatch.setattr(connect, "_await_handshake", lambda *args: _ready(restarted["config"]))
    monkeypatch.setattr(connect, "prepare", lambda config, resolved: SimpleNamespace(config=config))
    with pytest.raises(EngineDeadError, match="serves something else \\(max_logprobs 20 -> 5; "
                                              "model 'first-model' -> 'other-model'\\)"):
        connect.prepare_attached(attached, "ipc:///nowhere", 1.0, None, closed=lambda: False)
    restarted["config"] = attached.replace(stream_interval=7)  # a host-side field's default: no other core
    again = connect.prepare_attached(attached, "ipc:///nowhere", 1.0, None, closed=lambda: False,
                                     host_fields={"stream_interval": 2})
    assert again.config == attached


SERVES_OTHER_TOKENS = dict(dtype="float16", quantization="fp8", load_format="dummy", kv_cache_dtype="fp8", seed=7,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
                           structured_output_disable_any_whitespace=True)


@pytest.mark.parametrize("field", sorted(SERVES_OTHER_TOKENS))
def test_a_restarted_shared_core_with_other_weights_or_tokens_is_refused(field, monkeypatch) -> None:
    """A restarted core with another dtype, quantization, draft, ... would serve other tokens: refused by name, both
    values shown (as `model`), not taken silently as its memory settings are."""
    attached = EngineConfig.create("first-model", max_model_len=128, dtype="bfloat16")
    restarted = attached.replace(**{field: SERVES_OTHER_TOKENS[field]})
    monkeypatch.setattr(connect, "_await_handshake", lambda *args: _ready(restarted))
    monkeypatch.setattr(connect, "prepare", lambda config, resolved: SimpleNamespace(config=config))
    before, now = attached.to_dict(wire=True)[field], restarted.to_dict(wire=True)[field]
    with pytest.raises(EngineDeadError) as refused:
        connect.prepare_attached(attached, "ipc:///nowhere", 1.0, None, closed=lambda: False)
    assert f"serves something else ({field} {before!r} -> {now!r}):" in str(refused.value)


def test_a_restarted_shared_core_with_another_download_dir_is_taken(monkeypatch) -> None:
    """download_dir only says where hub ids are cached: the folders they resolved to (model, tokenizer, a draft's) are
    compared; the host takes the new core's cache (it resolves an `update_weights` hub id there, as the core)."""
    attached = EngineConfig.create("/models/first", max_model_len=128, download_dir="/cache/a")
    restarted = attached.replace(download_dir="/cache/b")
    monkeypatch.setattr(connect, "_await_handshake", lambda *args: _ready(restarted))
    monkeypatch.setattr(connect, "prepare", lambda config, resolved: SimpleNamespace(config=config))
    assert connect.prepare_attached(attached, "ipc:///nowhere", 1.0, None, closed=lambda: False).config == restarted


RESTARTED_WITH = dict(gpu_memory_utilization=0.8, enforce_eager=True, swap_space=2.0, max_num_seqs=8,
                      worker_step_timeout_s=30.0, max_num_queued_requests=5, max_model_len=96)


def test_a_restarted_shared_core_with_other_memory_scheduling_or_timeouts_is_taken(monkeypatch) -> None:
    """Only `connect.ATTACHED_FIELDS` must stay: the rest (and max_model_len, fitted again) is the new core's."""
    attached = EngineConfig.create("first-model", max_model_len=128, stream_interval=2)
    restarted = attached.replace(**RESTARTED_WITH, stream_interval=7)
    monkeypatch.setattr(connect, "_await_handshake", lambda *args: _ready(restarted))
    monkeypatch.setattr(connect, "prepare", lambda config, resolved: SimpleNamespace(config=config))
    again = connect.prepare_attached(attached, "ipc:///nowhere", 1.0, None, closed=lambda: False,
                                     host_fields={"stream_interval": 2})
    assert again.config == restarted.replace(stream_interval=2)


def test_an_attached_engine_shows_its_restarted_cores_config(monkeypatch, tmp_path) -> None:
    engine = AsyncEngine.connect(f"ipc://{tmp_path}/engine.sock", max_core_restarts=1)
    engine.config = EngineConfig.create("first-model", max_model_len=128, max_core_restarts=1)  # as `start` sets it
    restarted = engine.config.replace(**RESTARTED_WITH)

    async def start_replica(replica, config, spec, closed=None):
        replica.processor = SimpleNamespace(serve_max_model_len=lambda least: None)  # the new core's
        replica.max_model_len = 96
        return SimpleNamespace(config=restarted)

    async def nothing(*args) -> None:
        return None

    monkeypatch.setattr(async_engine, "start_replica", start_replica)
    monkeypatch.setattr(async_engine, "finish_in_thread", nothing)
    engine._replicas[0].processor = SimpleNamespace()
    asyncio.run(engine._restart_replica(0))
    assert engine.config == restarted
    assert engine._replicas[0].admission.max_num_queued_requests == 5  # the host's early check: the core's limit


def test_an_attached_host_takes_a_core_serving_a_hub_revision(tiny_llama, monkeypatch) -> None:
    """The core's config holds the local folders its hub id and revisions resolved to: the host takes it as is."""
    core = prepare(EngineConfig.create(tiny_llama)).config.replace(revision="v2", tokenizer_revision="v2")
    monkeypatch.setattr(connect, "_handshake_now", lambda *args: _ready(core))
    attached = connect.prepare_attached(EngineConfig.create("ipc:///core.sock"), "ipc:///core.sock", 1.0)
    assert (attached.config.model, attached.config.revision, attached.config.tokenizer_revision) == \
        (tiny_llama, "v2", "v2")
