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


@pytest.mark.parametrize("arch, why", [("gptj", "fixed theta of 10000"), ("opt", "opt has no rotary embedding")])
@pytest.mark.parametrize("overrides", [{"rope_theta": 3.0}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}])
def test_rope_keys_on_a_model_without_a_configurable_rope_are_refused(arch: str, why: str, overrides) -> None:
    """GPT-J's rotary turns at transformers' fixed theta, OPT has none: a rope key would be ignored."""
    with pytest.raises(ConfigError, match=why) as info:
        served_hf_config(tiny_checkpoint(arch), overrides)
    assert info.value.field == "hf_overrides"


def test_a_config_keeping_its_theta_outside_rope_parameters_gets_it_as_given() -> None:
    """A remote-code (or transformers 4) config with a rope_theta of its own: set, as the model reads it there."""
    from transformers import PretrainedConfig

    assert apply_hf_overrides(PretrainedConfig.from_dict({"rope_theta": 1e4}), {"rope_theta": 2e4}).rope_theta == 2e4
    with pytest.raises(ConfigError, match="only on a config with rope_parameters"):
        apply_hf_overrides(PretrainedConfig.from_dict({"rope_theta": 1e4}), {"partial_rotary_factor": 0.5})


def test_a_rotated_fraction_override_reaches_both_the_model_and_transformers() -> None:
    """partial_rotary_factor (GPT-NeoX's rotary_pct too) goes into rope_parameters, where transformers 5 and
    asyncllm/models/rotary.py read it: both rotate the new fraction of each 16-dim head."""
    from transformers import StableLmForCausalLM

    from asyncllm.models.rotary import compute_inv_freq

    served = served_hf_config(tiny_checkpoint("stablelm"), {"partial_rotary_factor": 0.5})  # its own: 0.25
    assert served.rope_parameters["partial_rotary_factor"] == 0.5
    hf_rotated = StableLmForCausalLM(served).model.layers[0].self_attn.rotary_ndims
    assert 2 * compute_inv_freq(served, 16)[0].numel() == hf_rotated == 8
    neox = served_hf_config(tiny_checkpoint("gpt_neox"), {"rotary_pct": 1.0})
    assert neox.rope_parameters["partial_rotary_factor"] == 1.0
    for bad in (1.5, 0, None):
        with pytest.raises(ConfigError, match="partial_rotary_factor"):
            served_hf_config(tiny_checkpoint("stablelm"), {"partial_rotary_factor": bad})


def test_hunyuan_s_fixed_alpha_rope_takes_overrides() -> None:
    """Hunyuan's "dynamic" rope with an alpha is built (hunyuan.ntk_alpha_config), so overrides on it pass;
    a plain dynamic NTK is still refused, and the alpha form on another model too (nothing builds it there)."""
    from transformers import HunYuanDenseV1Config, LlamaConfig

    alpha = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 1e4}
    config = HunYuanDenseV1Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  rope_parameters=dict(alpha))
    assert apply_hf_overrides(config, {"rope_theta": 2e4}).rope_parameters == {**alpha, "rope_theta": 2e4}
    with pytest.raises(ConfigError, match="not 'dynamic'"):
        apply_hf_overrides(config, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="not 'dynamic'"):
        apply_hf_overrides(LlamaConfig(), {"rope_scaling": dict(alpha)})


def test_a_fraction_transformers_ignores_is_dropped_and_logits_match(caplog) -> None:
    """transformers' Llama rotates the whole head with the default rope whatever partial_rotary_factor says
    (WHOLE_HEAD_MODEL_TYPES): the served config drops it (warned), an override giving it is refused; StableLM,
    whose transformers model reads it, keeps its own."""
    import logging

    import torch
    from model_utils import assert_paged_logits_match_checkpoint

    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import load_model

    path = tiny_checkpoint("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                      "partial_rotary_factor": 0.5})
    with caplog.at_level(logging.WARNING, logger="asyncllm.models.rope_config"):
        served = served_hf_config(path, None)
    assert served.rope_parameters["partial_rotary_factor"] == 1.0 and "is ignored" in caplog.text
    model = load_model(EngineConfig.create(path), served, torch.device("cpu"), torch.float32)
    assert_paged_logits_match_checkpoint(model, path, [12, 20], [[5, 9], [6, 10], [1, 1]], seed=3)
    with pytest.raises(ConfigError, match="no partial_rotary_factor for llama"):
        served_hf_config(tiny_checkpoint("llama"), {"partial_rotary_factor": 0.5})
    assert served_hf_config(tiny_checkpoint("stablelm"), None).rope_parameters["partial_rotary_factor"] == 0.25
