"""params.json's ``vision_encoder`` section (asyncllm/models/mistral_vision_format.py): the configs transformers'
conversion scripts make of Mistral Small 3.1's and Pixtral-12B's, the sections not built refused by name, the image
processor a folder without preprocessor_config.json gets, and the tower's names."""

from __future__ import annotations

import json

import pytest

from asyncllm.errors import NotBuiltError
from asyncllm.models.mistral_format import mistral_config
from asyncllm.models.mistral_vision_format import vision_name

TEXT = {"dim": 64, "n_layers": 2, "head_dim": 16, "hidden_dim": 128, "n_heads": 4, "n_kv_heads": 2, "norm_eps": 1e-5,
        "vocab_size": 512, "rope_theta": 1e9}
SMALL_31 = {"hidden_size": 32, "num_channels": 3, "max_image_size": 1540, "patch_size": 14, "rope_theta": 10000.0,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "adapter_bias": False,
            "mm_projector_id": "patch_merge", "spatial_merge_size": 2, "add_pre_mm_projector_layer_norm": True,
            "image_token_id": 10, "image_break_token_id": 12, "image_end_token_id": 13, "image_size": 1540}
"""Mistral Small 3.1's section, its tower shrunk."""
PIXTRAL_12B = {"hidden_size": 32, "num_channels": 3, "image_size": 1024, "patch_size": 16, "rope_theta": 10000.0,
               "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "image_token_id": 10,
               "image_break_token_id": 12, "image_end_token_id": 13}
"""Pixtral-12B-2409's section, its tower shrunk."""


def _folder(tmp_path, vision: dict) -> str:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "params.json").write_text(json.dumps({**TEXT, "vision_encoder": vision}))
    return str(tmp_path)


def test_mistral_small_31_becomes_mistral3_and_pixtral_12b_llava(tmp_path) -> None:
    small = mistral_config(_folder(tmp_path / "a", SMALL_31))
    assert small.architectures == ["Mistral3ForConditionalGeneration"] and small.spatial_merge_size == 2
    assert small.multimodal_projector_bias is False and small.image_token_id == 10
    assert small.vision_config.hidden_act == "silu" and small.vision_config.patch_size == 14
    assert small.vision_config.image_size == 1540 and small.text_config.hidden_size == 64
    pixtral = mistral_config(_folder(tmp_path / "b", PIXTRAL_12B))
    assert pixtral.architectures == ["LlavaForConditionalGeneration"] and pixtral.multimodal_projector_bias is True
    assert pixtral.vision_feature_select_strategy == "full" and pixtral.vision_feature_layer == -1
    assert pixtral.vision_config.model_type == "pixtral" and pixtral.projector_hidden_act == "gelu"
    assert pixtral.text_config.num_key_value_heads == 2


@pytest.mark.parametrize("change, named", [
    ({"video_token_id": 9}, "video_token_id"),
    ({"mm_projector_id": "mlp"}, "mm_projector_id"),
    ({"spatial_merge_size": 1}, "spatial_merge_size=1"),
    ({"add_pre_mm_projector_layer_norm": False}, "add_pre_mm_projector_layer_norm"),
    ({"image_break_token_id": 7}, "image_break_token_id"),
])
def test_a_section_not_built_is_refused_by_name(tmp_path, change, named) -> None:
    with pytest.raises(NotBuiltError, match=named):
        mistral_config(_folder(tmp_path, {**SMALL_31, **change}))


def test_a_folder_without_a_preprocessor_config_gets_params_json_image_settings(tmp_path) -> None:
    from asyncllm.mm.hf_processors import load_image_processor

    processor = load_image_processor(_folder(tmp_path, SMALL_31), {})
    assert processor.size["longest_edge"] == 1540 and processor.to_dict()["patch_size"] in (14, {"height": 14,
                                                                                                "width": 14})
    assert list(processor.image_mean) == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    resized = load_image_processor(str(tmp_path), {"size": {"longest_edge": 448}})
    assert resized.size["longest_edge"] == 448


def test_the_tower_and_adapters_names() -> None:
    assert (vision_name("vision_encoder.transformer.layers.3.attention.wk.weight")
            == "vision_tower.transformer.layers.3.attention.k_proj.weight")
    assert (vision_name("vision_encoder.transformer.layers.0.feed_forward.w1.weight")
            == "vision_tower.transformer.layers.0.feed_forward.gate_proj.weight")
    assert vision_name("vision_encoder.ln_pre.weight") == "vision_tower.ln_pre.weight"
    assert vision_name("vision_language_adapter.w_out.bias") == "multi_modal_projector.linear_2.bias"
    assert vision_name("pre_mm_projector_norm.weight") == "multi_modal_projector.norm.weight"
    assert vision_name("layers.0.attention.wq.weight") is None
