"""params.json read as transformers' MistralConfig, its unbuilt sections refused by name, and which folders are read
in Mistral's format (asyncllm/models/mistral_format.py)."""

from __future__ import annotations

import json

import pytest

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import load_hf_config
from asyncllm.models.hub import safetensors_patterns
from asyncllm.models.mistral_format import mistral_config, mistral_files, uses_mistral_config, uses_mistral_weights

PARAMS = {"dim": 64, "n_layers": 2, "head_dim": 16, "hidden_dim": 128, "n_heads": 4, "n_kv_heads": 2,
          "norm_eps": 1e-5, "vocab_size": 512, "rope_theta": 1e6}


def _folder(tmp_path, params: object = PARAMS, config: bool = False) -> str:
    (tmp_path / "params.json").write_text(json.dumps(params))
    if config:
        (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_params_json_is_a_mistral_config(tmp_path) -> None:
    config = load_hf_config(_folder(tmp_path, {**PARAMS, "sliding_window": 32, "moe": None}))
    assert config.architectures == ["MistralForCausalLM"] and config.model_type == "mistral"
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim, config.intermediate_size,
            config.num_attention_heads, config.num_key_value_heads) == (64, 2, 16, 128, 4, 2)
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rms_norm_eps == 1e-5
    assert (config.sliding_window, config.max_position_embeddings, config.tie_word_embeddings) == (32, 128_000, False)
    assert mistral_config(_folder(tmp_path, {**PARAMS, "max_seq_len": 4096})).max_position_embeddings == 4096
    no_kv = {k: v for k, v in PARAMS.items() if k != "n_kv_heads"}
    assert mistral_config(_folder(tmp_path, {**no_kv, "dtype": "bfloat16"})).num_key_value_heads == 4  # = n_heads
    for lengths in ({"max_seq_len": 40960, "max_position_embeddings": 131072},
                    {"max_position_embeddings": 131072, "max_seq_len": 40960}):  # the shorter, in either order
        assert mistral_config(_folder(tmp_path, {**PARAMS, **lengths})).max_position_embeddings == 40960


@pytest.mark.parametrize("extra, named", [
    ({"moe": {"num_experts": 8}}, "moe"),
    ({"multimodal": {"whisper_model_args": {}}}, "multimodal"),  # vision_encoder: test_mistral_vision_format.py
    ({"quantization": {"qformat_weight": "fp8_e4m3"}}, "quantization"),
    ({"yarn": {"factor": 4}}, "yarn"),
    ({"activation": "gelu"}, "activation"),
    ({"sliding_window": [None, 4096]}, "sliding_window"),
])
def test_unbuilt_sections_are_refused_by_name(tmp_path, extra: dict, named: str) -> None:
    with pytest.raises(NotBuiltError, match=named) as raised:
        mistral_config(_folder(tmp_path, {**PARAMS, **extra}))
    assert raised.value.field == "config_format"


@pytest.mark.parametrize("params", ["{not json", json.dumps([1, 2])])
def test_an_unreadable_params_json_is_a_config_error(tmp_path, params: str) -> None:
    (tmp_path / "params.json").write_text(params)
    with pytest.raises(ConfigError, match="params.json"):
        mistral_config(str(tmp_path))


def test_which_folders_are_read_in_mistrals_format(tmp_path) -> None:
    only, both, hf = tmp_path / "only", tmp_path / "both", tmp_path / "hf"
    for folder in (only, both, hf):
        folder.mkdir()
    _folder(only), _folder(both, config=True)
    (hf / "config.json").write_text("{}")
    assert uses_mistral_config(str(only)) and uses_mistral_weights(str(only))
    assert not uses_mistral_config(str(both)) and not uses_mistral_weights(str(both))
    assert uses_mistral_config(str(both), "mistral") and uses_mistral_weights(str(both), "mistral")
    assert not uses_mistral_config(str(only), "hf") and not uses_mistral_weights(str(only), "safetensors")
    assert safetensors_patterns(str(only)) == ["consolidated*.safetensors"] == safetensors_patterns(str(both),
                                                                                                    "mistral")
    assert safetensors_patterns(str(hf)) == ["*.safetensors"]
    with pytest.raises(ConfigError, match="consolidated"):
        mistral_files(str(only))


def test_config_format_is_checked() -> None:
    assert EngineConfig.create("m", config_format="mistral").config_format == "mistral"
    with pytest.raises(ConfigError) as raised:
        EngineConfig.create("m", config_format="gguf")
    assert raised.value.field == "config_format"


def test_load_format_mistral_without_consolidated_files_is_refused_before_spawning(tiny_llama: str) -> None:
    from asyncllm.engine.prepare import prepare

    with pytest.raises(ConfigError, match="consolidated") as raised:
        prepare(EngineConfig.create(tiny_llama, load_format="mistral"))
    assert raised.value.field == "load_format"
