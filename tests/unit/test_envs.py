"""asyncllm's environment variables (asyncllm/envs.py): an ``ASYNCLLM_*`` name it does not read is warned about at
engine start, not ignored silently."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from asyncllm import AsyncEngine, ConfigError, EngineConfig, envs

ROOT = Path(__file__).resolve().parents[2]


def test_unknown_names_are_the_asyncllm_ones_it_does_not_read() -> None:
    environ = {"ASYNCLLM_CPU_KVCACHE_SPACE": "0.01", "ASYNCLLM_CPU_KVCACHE_SPACE_GB": "1", "ASYNCLLM_TEST_SPAWN": "1",
               "ASYNCLLM_PARENT_PID": "3", "ASYNCLLM_LOGGING_LEVL": "DEBUG", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert envs.unknown_names(environ) == ["ASYNCLLM_CPU_KVCACHE_SPACE", "ASYNCLLM_LOGGING_LEVL"]


def test_every_name_the_code_reads_is_known() -> None:
    """The ``ASYNCLLM_*`` names in the package, workers and integrations are all in the registry (or set by asyncllm
    for its children), so none of them is ever warned about."""
    sources = [path for folder in ("asyncllm", "workers", "integrations", "kernels")
               for path in (ROOT / folder).rglob("*.py")]
    named = {name for path in sources for name in re.findall(r"ASYNCLLM_[A-Z0-9_]+", path.read_text())
             if not name.endswith("_")}  # a family written as ASYNCLLM_TEST_*
    assert named and envs.unknown_names(dict.fromkeys(named, "1")) == []


async def test_an_engine_start_warns_once_naming_them(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setenv("ASYNCLLM_CPU_KVCACHE_SPACE", "0.01")
    monkeypatch.setenv("ASYNCLLM_LOGGING_LEVL", "DEBUG")
    monkeypatch.setattr(envs, "_WARNED", set())  # warned once per process: not by an earlier test
    engine = AsyncEngine(str(tmp_path / "model"))

    async def no_replicas() -> None:  # the start stops where the replicas would be prepared and launched
        raise ConfigError("model", engine.config.model, "not started by this test")

    monkeypatch.setattr(engine, "_start_replicas", no_replicas)
    with caplog.at_level(logging.WARNING, logger="asyncllm"), pytest.raises(ConfigError, match="not started"):
        await engine.start()
    warned = [r.getMessage() for r in caplog.records if "unknown asyncllm environment" in r.getMessage()]
    assert warned == ["unknown asyncllm environment variable(s) ASYNCLLM_CPU_KVCACHE_SPACE, ASYNCLLM_LOGGING_LEVL: "
                      "asyncllm reads none of them (its variables are listed in "
                      "docs/configuration.md#environment-variables)"]


@pytest.mark.parametrize("var", [envs.CPU_KVCACHE_SPACE_GB, envs.ENGINE_STARTUP_TIMEOUT_S], ids=lambda var: var.name)
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "0", "-1", "abc"])
def test_a_float_variable_that_is_not_finite_and_positive_is_refused_naming_it(monkeypatch, var, raw: str) -> None:
    """float() alone took nan and inf, which crashed the workers (int(nan * 2**30)), and 0 or -1, whose error
    spoke of bytes left after the weights; a start-up timeout of nan or -1 timed out at once, inf never."""
    monkeypatch.setenv(var.name, raw)
    with pytest.raises(ConfigError) as info:
        var.get()
    assert info.value.field == var.name and info.value.value == raw
    monkeypatch.setenv(var.name, "0.5")
    assert var.get() == 0.5


def test_configure_logging_is_an_on_off_switch(monkeypatch) -> None:
    """vLLM reads int(VLLM_CONFIGURE_LOGGING): 1 or 0; a value that is neither was read as off without a word."""
    for raw, on in (("0", False), ("off", False), ("1", True), ("YES", True)):
        monkeypatch.setenv(envs.CONFIGURE_LOGGING.name, raw)
        assert envs.CONFIGURE_LOGGING.get() is on
    monkeypatch.setenv(envs.CONFIGURE_LOGGING.name, "2")
    with pytest.raises(ConfigError, match="ASYNCLLM_CONFIGURE_LOGGING='2' is not allowed"):
        envs.CONFIGURE_LOGGING.get()


@pytest.mark.parametrize("name", [envs.CPU_KVCACHE_SPACE_GB.name, envs.ENGINE_STARTUP_TIMEOUT_S.name,
                                  envs.CONFIGURE_LOGGING.name, envs.LOGGING_LEVEL.name, envs.XGRAMMAR_CACHE_MB.name,
                                  envs.DECODE_LINEAR.name, envs.WORKER_PIPELINE.name])  # (the last two: read by workers)
async def test_an_engine_start_refuses_a_bad_value_before_spawning(monkeypatch, tmp_path, name: str) -> None:
    monkeypatch.setenv(name, "nan")
    engine = AsyncEngine(str(tmp_path / "model"))

    async def no_replicas() -> None:  # reached only when the value was let through
        raise AssertionError("replicas started")

    monkeypatch.setattr(engine, "_start_replicas", no_replicas)
    with pytest.raises(ConfigError, match=f"{name}='nan' is not allowed"):
        await engine.start()


@pytest.mark.parametrize("name", [envs.MAX_NUM_BAD_WORDS.name, envs.MAX_BAD_WORDS_TOTAL_TOKENS.name])
def test_a_bad_bad_words_limit_is_refused_naming_the_variable_not_the_generation_config(monkeypatch, name) -> None:
    """`SamplingParams.validate` reads the bad-words limits, and the check of the model's sampling defaults (even
    none: every engine start) validates one: its ConfigError was reworded as ``generation_config={} is not allowed``
    (``override_generation_config=...`` with one), naming the wrong setting, until 2026-12-07."""
    from asyncllm.engine.defaults import default_sampling_fields

    monkeypatch.setenv(name, "abc")
    for check in (lambda: default_sampling_fields({}),
                  lambda: EngineConfig.create("m", override_generation_config={"temperature": 0.5})):
        with pytest.raises(ConfigError) as info:
            check()
        assert info.value.field == name and info.value.value == "abc"
