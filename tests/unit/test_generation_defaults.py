"""Default sampling parameters from generation_config.json (vLLM's --generation-config)."""

from __future__ import annotations

import json

import pytest

from asyncllm import ConfigError, EngineConfig
from asyncllm.engine.defaults import default_sampling_fields


def _folder(tmp_path, **fields) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return str(tmp_path)


def test_the_models_sampling_fields_become_defaults(tmp_path) -> None:
    folder = _folder(tmp_path, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=512, eos_token_id=1,
                     do_sample=True, bos_token_id=0)
    assert default_sampling_fields("auto", folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                       "max_tokens": 512}
    assert default_sampling_fields("vllm", folder) == {}
    assert default_sampling_fields("auto", folder, {"temperature": 0.1}) == {
        "temperature": 0.1, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    assert default_sampling_fields("vllm", folder, {"top_k": 5}) == {"top_k": 5}


def test_greedy_configs_keep_only_what_applies_to_greedy(tmp_path) -> None:
    folder = _folder(tmp_path, do_sample=False, temperature=0.7, repetition_penalty=1.1)
    assert default_sampling_fields("auto", folder) == {"repetition_penalty": 1.1}


def test_missing_and_bad_files(tmp_path) -> None:
    assert default_sampling_fields("auto", str(tmp_path)) == {}  # no file: no defaults
    with pytest.raises(ConfigError, match="generation_config"):
        default_sampling_fields(str(tmp_path), "/model")  # a folder given explicitly must hold one
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        default_sampling_fields("auto", str(tmp_path))


def test_override_generation_config_is_checked() -> None:
    EngineConfig.create("m", override_generation_config={"temperature": 0.5})
    for bad in ({"temperature": -1.0}, {"no_such_field": 1}, [1]):
        with pytest.raises(ConfigError) as info:
            EngineConfig.create("m", override_generation_config=bad)
        assert info.value.field == "override_generation_config"
