"""EngineConfig: vLLM field names, validation that names the field, unbuilt features refused."""

from __future__ import annotations

import dataclasses

import pytest

from asyncllm import AsyncEngine, ConfigError, EngineConfig, NotBuiltError
from asyncllm.config_checks import is_int

DESIGN_FIELDS = """model tokenizer dtype device seed max_model_len load_format block_size gpu_memory_utilization
num_gpu_blocks_override kv_cache_dtype enable_prefix_caching max_num_seqs max_num_batched_tokens
enable_chunked_prefill long_prefill_token_threshold preemption_mode swap_space scheduling_policy
max_num_queued_requests tensor_parallel_size pipeline_parallel_size data_parallel_size
enable_expert_parallel quantization enforce_eager attention_backend disable_log_stats log_stats_interval
prometheus_registry mm_processor_cache_gb mm_processor_cache_type mm_encoder_tp_mode speculative_config
enable_lora max_loras max_lora_rank max_cpu_loras""".split()


def test_every_design_field_exists_with_a_docstring() -> None:
    cfg = EngineConfig.create("m")
    flat = cfg.to_dict()
    for name in DESIGN_FIELDS:
        assert name in flat, name
        getattr(cfg, name)
    import inspect

    sections = [type(getattr(cfg, section.name)) for section in dataclasses.fields(cfg)]
    source = "".join(inspect.getsource(module) for module in dict.fromkeys(map(inspect.getmodule, sections)))
    for name in DESIGN_FIELDS:
        assert f'    {name}:' in source and '"""' in source.split(f"    {name}:", 1)[1].splitlines()[1], name


def test_sections_are_frozen() -> None:
    cfg = EngineConfig.create("m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache_config.block_size = 32  # type: ignore[misc]


def test_kwargs_and_from_config_agree() -> None:
    engine = AsyncEngine("some/model", block_size=32, max_num_seqs=8, dtype="float32")
    cfg = EngineConfig.create("some/model", block_size=32, max_num_seqs=8, dtype="float32")
    assert engine.config == cfg
    assert AsyncEngine.from_config(cfg).config == cfg
    assert EngineConfig.from_dict(cfg.to_dict(wire=True)) == cfg


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 3),
        ("dtype", "int8"),
        ("device", "tpu"),
        ("gpu_memory_utilization", 1.5),
        ("gpu_memory_utilization", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("tensor_parallel_size", 0),
        ("enable_prefix_caching", "yes"),
        ("load_format", "npcache"),
        ("log_stats_interval", 0),
        ("prometheus_registry", "default"),
        ("mm_processor_cache_type", "redis"),
        ("seed", -1),
        ("seed", 2**64),  # past torch's manual_seed: the workers would fail to start
        ("max_model_len", 0),
        ("max_num_queued_requests", 0),
        ("max_num_queued_tokens", 0),
        ("preemption_mode", "offload"),
        ("scheduling_policy", "lifo"),
        ("kv_cache_dtype", "fp8_e4m3fn"),  # torch's name, not vLLM's
        ("kv_cache_dtype", "fp4"),  # vLLM's int8 and bfloat16: test_fp8_kv_cache.py test_kv_cache_dtypes_vllm_accepts
        ("tokenizer_mode", "fast"),
        ("logprobs_mode", "logits"),
        ("kv_offloading_size", -1.0),
        ("prefix_caching_hash_algo", "builtin"),  # vLLM 0.8's, gone from vLLM since
        ("block_size", 16.0),  # equal to a choice, not an int: a worker's TypeError at start, until 2026-12-07
        ("block_size", True),  # equal to 1: the host's msgspec ValidationError at start, until 2026-12-07
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.create("m", **{field: value})
    assert info.value.field == field and not isinstance(info.value, NotBuiltError)
    assert field in str(info.value) and repr(value) in str(info.value)


def test_is_int_takes_ints_not_bools_or_numpys() -> None:
    """`is_int`, the one "an int, not a bool" test (config, host, server): JSON's true is not a count, and numpy's
    ints are refused as each of its callers refused them before."""
    import numpy as np

    assert all(is_int(value) for value in (0, -1, 2**70))
    assert not any(is_int(value) for value in (True, False, np.int64(3), 1.0, "1", None))
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig.create("m", max_num_seqs=True)


def test_seed_takes_torchs_generator_range() -> None:
    import torch

    seed = EngineConfig.create("m", seed=2**64 - 1).seed
    assert torch.Generator().manual_seed(seed).initial_seed() == seed


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        AsyncEngine("m", max_num_seq=3)
    assert info.value.field == "max_num_seq"


@pytest.mark.parametrize(
    "field, value",
    [
        ("quantization", "bitsandbytes"),
        ("speculative_config", {"method": "medusa", "num_speculative_tokens": 3}),
        ("tokenizer_mode", "custom"),
        ("prefix_caching_hash_algo", "sha256_cbor"),  # vLLM's others; sha256 (its default) is what asyncllm does
        ("prefix_caching_hash_algo", "xxhash"),
    ],
)
def test_unbuilt_features_raise_not_built(field: str, value: object) -> None:
    with pytest.raises(NotBuiltError) as info:
        EngineConfig.create("m", **{field: value})
    assert info.value.field == field and "not built yet" in str(info.value)


def test_vllms_default_prefix_caching_hash_algo_is_accepted() -> None:
    cfg = EngineConfig.create("m", prefix_caching_hash_algo="sha256")
    assert cfg.cache_config.prefix_caching_hash_algo == "sha256" == EngineConfig.create("m").prefix_caching_hash_algo


@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"])
def test_kv_cache_dtypes_are_accepted(value: str) -> None:
    cfg = EngineConfig.create("m", kv_cache_dtype=value)
    assert cfg.kv_cache_dtype == value == cfg.cache_config.kv_cache_dtype
    assert EngineConfig.from_dict(cfg.to_dict(wire=True)) == cfg


def test_default_batched_tokens() -> None:
    assert EngineConfig.create("m").resolved_max_num_batched_tokens == 8192
    no_chunk = EngineConfig.create("m", enable_chunked_prefill=False, max_model_len=20000)
    assert no_chunk.resolved_max_num_batched_tokens == 20000
    assert EngineConfig.create("m", max_num_batched_tokens=64).resolved_max_num_batched_tokens == 64


def test_max_num_seqs_is_at_most_the_budget() -> None:
    """As vLLM: an unset max_num_seqs is 256 at most the budget; a larger one set explicitly is a ConfigError."""
    assert EngineConfig.create("m").max_num_seqs == 256
    assert EngineConfig.create("m", max_num_batched_tokens=16).max_num_seqs == 16
    assert EngineConfig.create("m", max_num_batched_tokens=6, max_num_seqs=6).max_num_seqs == 6
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=2 .*equal to max_num_seqs \(6\)") as info:
        EngineConfig.create("m", max_num_batched_tokens=2, max_num_seqs=6)
    assert info.value.field == "max_num_batched_tokens"


def test_every_field_is_documented() -> None:
    import pathlib

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for name in EngineConfig.create("m").to_dict():
        assert f"| `{name}` |" in page, f"{name} missing from docs/configuration.md"


def test_the_cpu_prefix_cache_tier_needs_prefix_caching() -> None:
    with pytest.raises(ConfigError, match="enable_prefix_caching=False") as info:
        EngineConfig.create("m", kv_offloading_size=1.0, enable_prefix_caching=False)
    assert info.value.field == "kv_offloading_size"


def test_vllm_dtype_aliases_and_max_model_len_auto() -> None:
    assert [EngineConfig.create("m", dtype=d).dtype for d in ("half", "float")] == ["float16", "float32"]
    assert EngineConfig.create("m", max_model_len=-1).max_model_len == -1  # auto: fitted by the core
    for bad in (-2, 0, -1.0, True, "auto"):
        with pytest.raises(ConfigError, match=r"-1 \(fitted to the KV cache; the CLI's 'auto'\)") as info:
            EngineConfig.create("m", max_model_len=bad)
        assert info.value.field == "max_model_len"


def test_a_torch_dtype_is_kept_as_its_name() -> None:
    """vLLM's LLM takes ``dtype=torch.bfloat16``: the config keeps the name, so it travels as JSON as a str does."""
    import json

    import torch

    config = EngineConfig.create("m", dtype=torch.bfloat16)
    assert config.dtype == "bfloat16" and EngineConfig.create("m", dtype=torch.half).dtype == "float16"
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict(wire=True)))).dtype == "bfloat16"
    with pytest.raises(ConfigError, match="dtype='float64'"):
        EngineConfig.create("m", dtype=torch.float64)


def test_max_model_len_auto_is_the_kv_caches_capacity_capped_by_the_models() -> None:
    from asyncllm.engine.kv_budget import served_config

    config = EngineConfig.create("m", max_model_len=2048, block_size=16)  # 2048: the model's own, as prepared
    assert served_config(config, 10, auto_max_model_len=True).max_model_len == 160  # 10 blocks of 16
    assert served_config(config, 128, auto_max_model_len=True).max_model_len == 2048  # exactly the model's
    assert served_config(config, 500, auto_max_model_len=True).max_model_len == 2048  # never past the model's
    with pytest.raises(ConfigError, match="at most 160 tokens fit"):  # without auto: refused, as before
        served_config(config, 10, auto_max_model_len=False)


@pytest.mark.parametrize(("fields", "sized_by", "advice"), [
    ({}, "", "gpu_memory_utilization / kv_cache_memory_bytes / num_gpu_blocks_override"),
    ({}, "ASYNCLLM_CPU_KVCACHE_SPACE_GB", "ASYNCLLM_CPU_KVCACHE_SPACE_GB / kv_cache_memory_bytes / "
                                          "num_gpu_blocks_override"),
    ({"kv_cache_memory_bytes": 2**20}, "kv_cache_memory_bytes", "kv_cache_memory_bytes / num_gpu_blocks_override"),
    ({"num_gpu_blocks_override": 10}, "ASYNCLLM_CPU_KVCACHE_SPACE_GB", "num_gpu_blocks_override"),
])
def test_a_kv_cache_too_small_advises_raising_what_sized_it(fields, sized_by: str, advice: str) -> None:
    """On the CPU the workers size the cache by ASYNCLLM_CPU_KVCACHE_SPACE_GB and ignore gpu_memory_utilization."""
    from asyncllm.engine.kv_budget import served_config

    config = EngineConfig.create("m", max_model_len=2048, block_size=16, **fields)
    with pytest.raises(ConfigError) as info:
        served_config(config, 10, False, sized_by)
    assert str(info.value).endswith(f"or raise {advice}")


def test_replace_derives_an_unset_max_num_seqs_from_the_new_budget() -> None:
    """`max_num_seqs` unset is 256 at most the step budget (vLLM's): `replace` of the budget alone kept the value
    derived from the old one, so ``create(m).replace(max_num_batched_tokens=100)`` was a ConfigError (256 > 100) where
    ``create(m, max_num_batched_tokens=100)`` is fine, until 2026-12-07. A value given stays."""
    base = EngineConfig.create("m")
    assert base.replace(max_num_batched_tokens=100).max_num_seqs == 100
    small = EngineConfig.create("m", max_num_batched_tokens=100)
    assert small.replace(max_num_batched_tokens=8192).max_num_seqs == 256
    assert small.replace(seed=1).max_num_seqs == 100
    assert EngineConfig.create("m", max_num_seqs=8).replace(max_num_batched_tokens=100).max_num_seqs == 8
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig.create("m", max_num_seqs=64).replace(max_num_batched_tokens=32)
