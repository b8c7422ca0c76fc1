"""M-RoPE (asyncllm/models/mrope.py): prompt positions and rotations equal to transformers' Qwen2-VL."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncllm.errors import ConfigError
from asyncllm.models.mrope import MRotaryEmbedding, mrope_positions


def _hf_model():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                        "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, spatial_merge_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=60, video_token_id=61)
    return Qwen2VLForConditionalGeneration(config).eval()


def _prompt(pieces: list[object]) -> tuple[list[int], list[tuple[int, int, tuple[int, int, int]]]]:
    """Text lengths and image grids -> (token ids, images as mrope_positions takes them)."""
    ids: list[int] = []
    images = []
    for piece in pieces:
        if isinstance(piece, int):
            ids += [5] * piece
        else:
            t, h, w = piece
            length = t * h * w // 4
            images.append((len(ids), length, (t, h, w)))
            ids += [60] * length
    return ids, images


@pytest.mark.parametrize("pieces", [
    [3, (1, 4, 6), 5, (1, 8, 4), 2],  # two images of different grids, text around them
    [(1, 6, 6), 4],                   # an image first
    [2, (1, 10, 4)],                  # an image last: the delta comes from the image's rows
    [7],                              # text only
])
def test_prompt_positions_and_delta_equal_transformers_get_rope_index(pieces):
    ids, images = _prompt(pieces)
    table, delta = mrope_positions(len(ids), images, spatial_merge_size=2)
    model = _hf_model()
    input_ids = torch.tensor([ids])
    grids = torch.tensor([grid for _, _, grid in images]) if images else None
    hf_positions, hf_delta = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == 60).int(), image_grid_thw=grids)
    assert np.array_equal(table, hf_positions[:, 0].numpy())
    assert delta == int(hf_delta[0, 0])
    if images:
        assert delta < 0  # an image spans fewer positions than tokens


def _qwen25_model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                        "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  spatial_merge_size=2, tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=60, video_token_id=61)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.mark.parametrize("seconds, equal_to_transformers", [(0.5, True), (1 / 3, True), (2.0, False)])
def test_video_positions_space_time_as_qwen25_and_text_resumes_past_the_video(seconds, equal_to_transformers):
    """A video's temporal patches ``tokens_per_second x seconds`` apart (truncated in float32, transformers'
    rounding); the text after it from the video's largest position + 1, the Qwen rule, which transformers >= 5.3
    follows too while the video's time axis stays within its rows and columns."""
    from qwen_vl_utils import qwen_rope_positions

    ids = [5] * 3 + [61] * (4 * 8 * 6 // 4) + [5] * 4 + [60] * 4 + [5] * 2  # a 4 x 8 x 6 video, then a 1 x 4 x 4 image
    interval = float(np.float32(2) * np.float32(seconds))
    items = [(3, 48, (4, 8, 6), interval), (55, 4, (1, 4, 4))]
    table, delta = mrope_positions(len(ids), items, spatial_merge_size=2)
    reference = qwen_rope_positions(ids, 60, 61, [[1, 4, 4]], [[4, 8, 6]], [interval])[1:, 0].numpy()
    assert np.array_equal(table, reference) and delta == int(reference.max()) + 1 - len(ids)
    input_ids = torch.tensor([ids])
    hf, _ = _qwen25_model().model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == 60).int() + 2 * (input_ids == 61).int(),
        image_grid_thw=torch.tensor([[1, 4, 4]]), video_grid_thw=torch.tensor([[4, 8, 6]]),
        second_per_grid_ts=torch.tensor([seconds]))
    assert np.array_equal(table[:, 3:51], hf[:, 0, 3:51].numpy())  # the video itself: always equal
    assert np.array_equal(table, hf[:, 0].numpy()) == equal_to_transformers


def test_a_grid_that_does_not_match_its_placeholders_is_refused():
    with pytest.raises(ValueError, match="placeholder"):
        mrope_positions(10, [(2, 5, (1, 4, 4))], spatial_merge_size=2)


def test_step_table_equals_transformers_rotation_bit_for_bit():
    model = _hf_model()
    config = model.config.text_config
    rotary = MRotaryEmbedding(config, head_dim=16, max_position=128)
    ids, images = _prompt([3, (1, 4, 6), 5, (1, 8, 4), 2])
    table, _ = mrope_positions(len(ids), images, spatial_merge_size=2)
    positions = torch.from_numpy(table)
    ours = rotary.step_table(positions)
    x = torch.zeros(1, len(ids), 16)
    cos, sin = model.model.language_model.rotary_emb(x, positions[:, None, :])
    half = ours.shape[1] // 2
    assert torch.equal(ours[:, :half], cos[0, :, :half]) and torch.equal(ours[:, half:], sin[0, :, :half])
    text_only = torch.arange(6).expand(3, 6)  # equal axes: the ordinary table's rows
    assert torch.equal(rotary.step_table(text_only), rotary.cos_sin_cache[:6])


def test_rotating_by_restores_the_ordinary_table():
    rotary = MRotaryEmbedding(_hf_model().config.text_config, head_dim=16, max_position=32)
    ordinary = rotary.cos_sin_cache
    with rotary.rotating_by(torch.tensor([[0, 1], [0, 2], [0, 3]])) as flat:
        assert flat.tolist() == [0, 1] and rotary.cos_sin_cache.shape == (2, 16)
    assert rotary.cos_sin_cache is ordinary


def test_sections_that_do_not_cover_the_rotary_width_are_a_config_error():
    config = _hf_model().config.text_config
    config.rope_parameters = {**config.rope_parameters, "mrope_section": [2, 2, 2]}
    with pytest.raises(ConfigError, match="mrope_section"):
        MRotaryEmbedding(config, head_dim=16, max_position=32)


def test_qwen3_vl_interleaved_rotation_equals_transformers_bit_for_bit():
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from asyncllm.models.mrope import frequency_axes

    text = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    config = Qwen3VLConfig(text_config=text).text_config
    rotary = MRotaryEmbedding(config, head_dim=16, max_position=128, interleaved=True)
    assert frequency_axes([2, 3, 3], True).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]  # t h w t h w t h
    ids, images = _prompt([3, (1, 4, 6), 5, (1, 8, 4), 2])
    positions = torch.from_numpy(mrope_positions(len(ids), images, spatial_merge_size=2)[0])
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1, len(ids), 16), positions[:, None, :])
    ours = rotary.step_table(positions)
    assert torch.equal(ours[:, :8], cos[0, :, :8]) and torch.equal(ours[:, 8:], sin[0, :, :8])


def test_fused_experts_of_either_layout_split_into_the_same_per_expert_matrices():
    from asyncllm.models.qwen3_vl_moe import per_expert_weights

    hidden, inter = 6, 2
    gate_up = torch.randn(3, 2 * inter, hidden)  # transformers 5: [E, 2I, hidden]
    down = torch.randn(3, hidden, inter)
    name = "model.layers.0.mlp.experts."
    new = dict(per_expert_weights(name + "gate_up_proj", gate_up, hidden, inter))
    new.update(per_expert_weights(name + "down_proj", down, hidden, inter))
    old = dict(per_expert_weights(name + "gate_up_proj", gate_up.transpose(1, 2), hidden, inter))  # 4.57's
    old.update(per_expert_weights(name + "down_proj", down.transpose(1, 2), hidden, inter))
    assert new.keys() == old.keys() and len(new) == 9
    assert all(torch.equal(new[k], old[k]) for k in new)
    assert torch.equal(new[name + "1.up_proj.weight"], gate_up[1, inter:])
    with pytest.raises(ConfigError, match="fused experts of shape"):
        list(per_expert_weights(name + "down_proj", torch.zeros(3, 5, 5), hidden, inter))
    with pytest.raises(ConfigError, match="fused experts of shape"):  # square: either layout would fit
        list(per_expert_weights(name + "down_proj", torch.zeros(3, 4, 4), 4, 4))
