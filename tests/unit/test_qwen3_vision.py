"""The Qwen3-VL vision tower against transformers' ``model.visual`` (over two ranks, sharded by weights: the
Qwen3-VL-MoE engine test in tests/engine/test_qwen_vl_versions_engine.py)."""

from __future__ import annotations

import pytest
import torch
from qwen_vl_utils import load_tower, random_patches
from transformers import Qwen3VLConfig

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.qwen3_vision import Qwen3VisionTower

FP32_RELATIVE = 3e-6
"""Ours vs transformers in float32, as a fraction of the output's largest magnitude (measured: 1e-6). The features
are O(10) (random weights, 1536 pixels per patch), and the patch embedding, a matmul here and a Conv3d there, sums
in another order: 5e-5 apart on values of 30, the whole difference (the blocks and mergers agree bit for bit)."""


def _assert_close(got: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    scale = expected.abs().max().item()
    assert scale > 1.0, msg  # the features are not vanishing, so the bound is not vacuous
    torch.testing.assert_close(got, expected, atol=FP32_RELATIVE * scale, rtol=0.0, msg=msg)


def _config() -> Qwen3VLConfig:
    # side 8 position table: the grids below resample it both down (4 x 6) and up (8 x 12)
    return Qwen3VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=600,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3,
                           out_hidden_size=64, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 1]))


PATCH_PIXELS = 3 * 2 * 16 * 16
OUT, DEEPSTACK = 64, 2
GRIDS = {
    "two images": [(1, 4, 6), (1, 8, 8)],
    "a clip and a one-unit image": [(2, 4, 4), (1, 2, 2)],  # frames share position embeddings, attend apart
    "one image": [(1, 8, 12)],
}


def _hf_tower(seed: int = 0) -> torch.nn.Module:
    """transformers' vision model with random weights (norm scales ~N(1, 0.2), the rest ~N(0, 0.2)).

    Imported here, not at the top, so that the spawned ranks skip transformers' modeling modules (seconds)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(seed)
    model = Qwen3VLVisionModel(_config().vision_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_scale = "norm" in name and name.endswith("weight")
            param.normal_(1.0 if is_scale else 0.0, 0.2)
    return model


def _tower(weights: dict[str, torch.Tensor], tp: TensorParallel | None = None,
           dtype: torch.dtype = torch.float32) -> Qwen3VisionTower:
    return load_tower(Qwen3VisionTower(_config().vision_config, tp or TensorParallel(), dtype), weights)


def _pixels(grids: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    return random_patches(grids, PATCH_PIXELS, seed)


def test_matches_transformers_merger_and_deepstack_features_for_several_images_and_one():
    hf = _hf_tower()
    ours = _tower(hf.state_dict())
    assert ours.num_deepstack == DEEPSTACK
    for case, grids in GRIDS.items():
        pixels = _pixels(grids)
        with torch.no_grad():
            expected = hf(pixels, grid_thw=torch.tensor(grids))
            got = ours(pixels, grids)
        assert got.shape == (pixels.shape[0] // 4, OUT * (1 + DEEPSTACK)) and got.dtype == torch.float32, case
        parts = [expected.pooler_output, *expected.deepstack_features]
        assert len(parts) == 1 + DEEPSTACK, case
        for index, (mine, theirs) in enumerate(zip(got.split(OUT, dim=-1), parts)):
            _assert_close(mine, theirs, f"{case}: part {index}")


def test_parameter_names_are_the_checkpoints_under_model_visual():
    from transformers import Qwen3VLForConditionalGeneration

    prefix = "model.visual."
    names = {name[len(prefix):] for name in Qwen3VLForConditionalGeneration(_config()).state_dict()
             if name.startswith(prefix)}
    assert names == dict(Qwen3VisionTower(_config().vision_config, TensorParallel(), torch.float32)
                         .named_parameters()).keys()


def test_bfloat16_tower_stays_near_the_float32_one():
    weights = _hf_tower().state_dict()
    grids = GRIDS["two images"]
    pixels = _pixels(grids)
    with torch.no_grad():
        expected = _tower(weights)(pixels, grids)
        got = _tower(weights, dtype=torch.bfloat16)(pixels, grids)
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: measured 0.7% off in norm, 3x margin; a wrong dtype path is ~100% off
    assert ((got.float() - expected).norm() / expected.norm()).item() < 0.02


def test_refuses_other_towers_shards_that_do_not_split_bad_deepstack_and_bad_inputs():
    config = _config().vision_config
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 .*num_heads=4.*intermediate_size=64"):
        Qwen3VisionTower(config, TensorParallel(0, 3), torch.float32)
    tower = Qwen3VisionTower(config, TensorParallel(), torch.float32)
    with pytest.raises(ValueError, match="spatial_merge_size=2"):
        tower(_pixels([(1, 3, 4)]), [(1, 3, 4)])
    with pytest.raises(ValueError, match="48 patches of pixels"):
        tower(_pixels([(1, 4, 12)]), [(1, 4, 4)])
    for indexes in ([0, 3], [1, 1]):
        config.deepstack_visual_indexes = indexes
        with pytest.raises(ConfigError, match="deepstack_visual_indexes"):
            Qwen3VisionTower(config, TensorParallel(), torch.float32)
    config.model_type = "qwen2_5_vl_vision"
    with pytest.raises(NotBuiltError, match="qwen2_5_vl_vision"):
        Qwen3VisionTower(config, TensorParallel(), torch.float32)
