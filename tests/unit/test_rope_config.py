"""hf_overrides' rope keys folded into transformers 5's rope_parameters, checked on the host, and the max length
a rope scaling allows (vLLM's patch_rope_parameters and _get_and_verify_max_len)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from asyncllm import ConfigError
from asyncllm.models.architectures import max_positions
from asyncllm.models.checkpoint import apply_hf_overrides, served_hf_config
from asyncllm.models.rope_config import rope_scaled_length
from asyncllm.tiny import tiny_checkpoint


def test_rope_theta_and_rope_scaling_go_into_rope_parameters() -> None:
    path = tiny_checkpoint("llama")
    assert served_hf_config(path, {"rope_theta": 1e6}).rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    scaling = {"rope_type": "linear", "factor": 4.0}
    overrides = {"rope_scaling": scaling}
    assert served_hf_config(path, overrides).rope_parameters == {"rope_type": "linear", "factor": 4.0,
                                                                 "rope_theta": 10000.0}  # the model's theta kept
    assert overrides == {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    legacy = {"rope_parameters": {"type": "linear", "factor": 2.0, "rope_theta": 1e4}}  # transformers adds rope_type
    assert served_hf_config(path, legacy).rope_parameters["rope_type"] == "linear"
    assert legacy == {"rope_parameters": {"type": "linear", "factor": 2.0, "rope_theta": 1e4}}  # the user's dicts kept


@pytest.mark.parametrize("scaling", [{"rope_type": "linear"}, {"rope_type": "nope", "factor": 2.0},
                                     {"rope_type": "linear", "factor": "x"}, [4.0]])
def test_a_bad_rope_is_a_config_error_on_the_host(scaling) -> None:
    with pytest.raises(ConfigError) as info:
        served_hf_config(tiny_checkpoint("llama"), {"rope_scaling": scaling})
    assert info.value.field == "hf_overrides"


def test_a_direct_rope_parameters_override_keeps_the_model_s_theta_and_errors_quote_it_as_given() -> None:
    from transformers import LlamaConfig

    def llama() -> Any:
        return LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5})

    linear = {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}
    assert apply_hf_overrides(llama(), linear).rope_parameters == {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 5e5}
    missing_factor = {"rope_parameters": {"rope_type": "linear"}}
    with pytest.raises(ConfigError) as info:
        apply_hf_overrides(llama(), missing_factor)
    assert f"hf_overrides={missing_factor!r} " in str(info.value)  # not transformers' standardized copy
    assert missing_factor == {"rope_parameters": {"rope_type": "linear"}}


def _qwen2_vl_config() -> Any:
    """A Qwen2-VL config as transformers 5 reads one: the rope parameters (M-RoPE's) on the text config only."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(text_config={"max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}})


def test_rope_overrides_on_a_multimodal_model_go_to_its_text_config() -> None:
    overrides = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 5e6}
    config = apply_hf_overrides(_qwen2_vl_config(), overrides)
    assert config.text_config.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e6,
                                                  "mrope_section": [4, 6, 6],
                                                  "original_max_position_embeddings": 1024}
    assert max_positions(config.text_config) == 4096
    assert getattr(config, "rope_parameters", None) is None  # nothing left on the outer config
    direct = apply_hf_overrides(_qwen2_vl_config(), {"rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    assert direct.text_config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6,
                                                  "mrope_section": [4, 6, 6]}


def test_a_rope_type_no_worker_builds_is_refused_on_the_host() -> None:
    with pytest.raises(ConfigError, match="not 'dynamic'") as info:
        served_hf_config(tiny_checkpoint("llama"), {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert info.value.field == "hf_overrides"


def _config(model_type: str = "llama", **params) -> types.SimpleNamespace:
    return types.SimpleNamespace(model_type=model_type, max_position_embeddings=2048, rope_parameters=params)


def test_the_max_length_grows_with_the_rope_scaling_factor() -> None:
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    assert rope_scaled_length(_config(**yarn), 2048) == 4096  # YaRN: from the original length
    assert rope_scaled_length(_config(rope_type="linear", factor=2.0), 2048) == 4096
    assert rope_scaled_length(_config(rope_type="llama3", factor=8.0), 2048) == 2048  # already counted
    assert rope_scaled_length(_config("gemma3_text", rope_type="linear", factor=8.0), 2048) == 2048
    per_layer = _config(sliding_attention={"rope_type": "default"}, full_attention=yarn)
    assert max_positions(per_layer) == 4096
    assert max_positions(_config(rope_type="default")) == 2048
