"""HunYuan VL's parts against transformers': the XD-RoPE positions (`xd_positions` vs ``get_rope_index``) and the
step's rotation (`XDRotaryEmbedding` vs ``HunYuanVLRotaryEmbedding`` and ``apply_rotary_pos_emb``), with four axes
and with three; the checkpoint's names in both layouts. End to end: tests/engine/test_hunyuan_vl_engine.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from hunyuan_vl_utils import IMAGE_PLACEHOLDER, hf_hunyuan_vl_inputs, make_tiny_hunyuan_vl
from mm_utils import make_image

from asyncllm.models.hunyuan_vl import XDRotaryEmbedding, normalize_hunyuan_vl_name, xd_positions

SECTIONS = {"four axes": (2, 2, 2, 2), "three axes": (4, 2, 2)}


@pytest.fixture(scope="module", params=sorted(SECTIONS))
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hunyuan_vl(tmp_path_factory.mktemp("hunyuan_vl"), sections=SECTIONS[request.param])


def _two_image_inputs(path: str) -> dict:
    images = [make_image(60, 200, seed=2), make_image(150, 60, seed=3)]
    return hf_hunyuan_vl_inputs(path, f"a {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} end", images)


def test_positions_equal_transformers_rope_index(checkpoint: str) -> None:
    """Each image's grid tokens at (column with the newline's, row, the image's ordinal) on the last three axes,
    every other token at its index: transformers' table, exactly, and its delta."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    inputs = _two_image_inputs(checkpoint)
    expected, deltas = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               inputs["image_grid_thw"])
    types = inputs["mm_token_type_ids"][0].tolist()
    runs, start = [], 0
    for kind, run in itertools.groupby(types):  # each image's placeholders: (offset, length)
        length = len(list(run))
        runs += [(start, length)] if kind == 1 else []
        start += length
    items = [(s, n, tuple(g)) for (s, n), g in zip(runs, inputs["image_grid_thw"].tolist(), strict=True)]
    table, delta = xd_positions(inputs["input_ids"].shape[1], items, 2, len(expected))
    assert torch.equal(torch.from_numpy(table), expected[:, 0]) and delta == int(deltas[0, 0]) == 0
    assert table[-1, items[1][0] + 1] == 1 and table[-1, items[0][0] + 1] == 0  # each image's ordinal
    with pytest.raises(ValueError, match="placeholder tokens"):
        xd_positions(inputs["input_ids"].shape[1], [(items[0][0], items[0][1] - 1, items[0][2])], 2, len(expected))


def test_step_rotation_equals_transformers(checkpoint: str) -> None:
    """q and k turned by the step's XD-RoPE tables equal transformers' rotation at the same positions; ``[T]``
    positions turn as the ordinary rope (every axis equal)."""
    from transformers import AutoConfig
    from transformers.models.hunyuan_vl.modeling_hunyuan_vl import HunYuanVLRotaryEmbedding, apply_rotary_pos_emb

    text = AutoConfig.from_pretrained(checkpoint).text_config
    axes = len(text.rope_parameters["mrope_section"])
    positions = torch.randint(0, 40, (axes, 9), generator=torch.Generator().manual_seed(0))
    q, k = torch.randn(9, 4, 16), torch.randn(9, 2, 16)
    hf = HunYuanVLRotaryEmbedding(text)
    rotary = XDRotaryEmbedding(text, 16, 64)
    for table in (positions, positions[:1].expand(axes, -1)):
        cos, sin = hf(q, table[:, None])
        want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        with rotary.rotating_by(table) as flat:
            got_q, got_k = rotary(flat, q, k)
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    plain_q, _ = rotary(positions[0], q, k)  # [T] positions: every axis at them
    torch.testing.assert_close(plain_q, got_q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("theirs, ours", [
    ("vit.perceive.proj.0.weight", "visual.merger.proj_conv.weight"),
    ("model.vision_tower.patch_merger.proj_out.bias", "visual.merger.proj_out.bias"),
    ("vit.perceive.image_newline", "visual.merger.image_newline"),
    ("vit.layers.3.input_layernorm.weight", "visual.encoder.layers.3.layer_norm1.weight"),
    ("model.vision_tower.layers.3.layer_norm2.bias", "visual.encoder.layers.3.layer_norm2.bias"),
    ("vit.layers.0.mlp.dense_4h_to_h.weight", "visual.encoder.layers.0.mlp.fc2.weight"),
    ("vit.layers.0.self_attn.o_proj.bias", "visual.encoder.layers.0.self_attn.out_proj.bias"),
    ("vit.embeddings.position_embedding.weight", "visual.embeddings.position_embedding.weight"),
    ("model.layers.1.self_attn.o_proj.weight", "language_model.model.layers.1.self_attn.o_proj.weight"),
    ("model.language_model.norm.weight", "language_model.model.norm.weight"),
    ("lm_head.weight", "language_model.lm_head.weight"),
])
def test_checkpoint_names_in_either_layout(theirs: str, ours: str) -> None:
    assert normalize_hunyuan_vl_name(theirs) == ours


@pytest.mark.parametrize("setting", [{}, {"interpolate_mode": "bicubic"}, {"hidden_act": "gelu_pytorch_tanh"}])
def test_patch_embedding_and_merger_follow_their_vision_config(setting: dict) -> None:
    """The position table resampled by ``interpolate_mode`` and the merger's activation the tower's ``hidden_act``,
    as transformers' modules on the same weights; a mode transformers' call cannot take is refused."""
    from transformers.models.hunyuan_vl.configuration_hunyuan_vl import HunYuanVLVisionConfig
    from transformers.models.hunyuan_vl.modeling_hunyuan_vl import HunYuanVLVisionPatchEmbed, HunYuanVLVisionPatchMerger

    from asyncllm.errors import NotBuiltError
    from asyncllm.models.hunyuan_vl import HunYuanVLPatchMerger, HunYuanVLVisionEmbeddings

    torch.manual_seed(0)
    cfg = HunYuanVLVisionConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, patch_size=8,
                                max_image_size=64, spatial_merge_size=2, text_hidden_size=48, **setting)
    theirs, ours = HunYuanVLVisionPatchEmbed(cfg).eval(), HunYuanVLVisionEmbeddings(cfg)
    for param in theirs.parameters():
        param.data.normal_()
    ours.load_state_dict(theirs.state_dict(), strict=False)
    rows, cols, patches = 6, 4, torch.randn(24, 3 * 8 * 8)
    merger_theirs, merger_ours = HunYuanVLVisionPatchMerger(cfg).eval(), HunYuanVLPatchMerger(cfg, 48, torch.float32)
    for param in merger_theirs.parameters():
        param.data.normal_()
    merger_ours.load_state_dict({k.replace("proj.0", "proj_conv").replace("proj.2", "proj_out"): v
                                 for k, v in merger_theirs.state_dict().items()}, strict=False)
    hidden = torch.randn(1, rows * cols, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(patches, 1, rows, cols)[0], theirs(patches, [[1, rows, cols]])[0])
        torch.testing.assert_close(merger_ours(hidden, rows, cols), merger_theirs(hidden, (rows, cols)))
    cfg.interpolate_mode = "nearest"
    with pytest.raises(NotBuiltError, match="interpolate_mode"):
        HunYuanVLVisionEmbeddings(cfg)
