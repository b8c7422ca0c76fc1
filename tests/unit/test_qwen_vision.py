"""The Qwen2-VL / Qwen2.5-VL vision tower against transformers' ``model.visual``, whole and over two gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
from model_utils import free_port, gloo_rank, spawn_ranks
from qwen_vl_utils import load_tower, random_patches
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.qwen_vision import QwenVisionTower

FP32_TOLERANCE = {"atol": 1e-5, "rtol": 0.0}
"""Ours vs transformers in float32 (outputs are O(1)): only the matmul / SDPA summation order differs."""

VISION_CONFIGS = {  # the shapes tests/qwen_vl_utils.py builds checkpoints with
    "2": lambda: Qwen2VLConfig(vision_config=dict(
        depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, in_channels=3, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2)).vision_config,
    "2.5": lambda: Qwen2_5_VLConfig(vision_config=dict(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=4, in_channels=3, out_hidden_size=64,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
        fullatt_block_indexes=[1])).vision_config,
}
PATCH_PIXELS = 3 * 2 * 14 * 14
GRIDS = {
    # 2.5: windows are 2 x 2 merge units, so (1, 6, 10) (3 x 5 units) has partial windows; two frames of (2, 4, 4)
    # attend within their frame in the full-attention block
    "two images": [(1, 4, 6), (1, 8, 8)],
    "partial windows and a clip": [(1, 6, 10), (2, 4, 4), (1, 2, 2)],
    "one image": [(1, 8, 12)],
}


def _hf_tower(version: str, seed: int = 0) -> torch.nn.Module:
    """transformers' vision model with random weights (norm scales ~N(0, 1), the rest ~N(0, 0.2)).

    Imported here, not at the top, so that the spawned ranks skip transformers' modeling modules (seconds)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    tower_cls = Qwen2VisionTransformerPretrainedModel if version == "2" else Qwen2_5_VisionTransformerPretrainedModel
    torch.manual_seed(seed)
    model = tower_cls(VISION_CONFIGS[version]()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 1.0 if "norm" in name and name.endswith("weight") else 0.2)
    return model


def _tower(version: str, weights: dict[str, torch.Tensor], tp: TensorParallel | None = None) -> QwenVisionTower:
    return load_tower(QwenVisionTower(VISION_CONFIGS[version](), tp or TensorParallel(), torch.float32), weights)


def _pixels(grids: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    return random_patches(grids, PATCH_PIXELS, seed)


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_matches_transformers_visual_for_several_images_and_one(version):
    hf = _hf_tower(version)
    ours = _tower(version, hf.state_dict())
    for case, grids in GRIDS.items():
        pixels = _pixels(grids)
        with torch.no_grad():
            expected = hf(pixels, grid_thw=torch.tensor(grids)).pooler_output
            got = ours(pixels, grids)
        assert got.shape == (pixels.shape[0] // 4, 64) and got.dtype == torch.float32, case
        assert expected.abs().max() > 0.5, case  # the outputs are O(1), so atol is a relative bound too
        torch.testing.assert_close(got, expected, **FP32_TOLERANCE, msg=case)


def test_window_attention_is_what_separates_the_qwen2_5_tower_from_full_attention():
    """With every block full-attention the output differs: the windowed blocks are exercised by the grids above."""
    hf = _hf_tower("2.5")
    config = VISION_CONFIGS["2.5"]()
    config.fullatt_block_indexes = [0, 1, 2]
    full = QwenVisionTower(config, TensorParallel(), torch.float32)
    full.load_state_dict(hf.state_dict())
    grids = GRIDS["partial windows and a clip"]
    pixels = _pixels(grids)
    with torch.no_grad():
        assert (full(pixels, grids) - _tower("2.5", hf.state_dict())(pixels, grids)).abs().max() > 1e-2


def test_refuses_other_towers_shards_that_do_not_split_and_bad_inputs():
    config = VISION_CONFIGS["2"]()
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 .*num_heads=4.*MLP width=64"):
        QwenVisionTower(config, TensorParallel(0, 3), torch.float32)
    tower = QwenVisionTower(config, TensorParallel(), torch.float32)
    with pytest.raises(ValueError, match="spatial_merge_size=2"):
        tower(_pixels([(1, 3, 4)]), [(1, 3, 4)])
    with pytest.raises(ValueError, match="48 patches of pixels"):
        tower(_pixels([(1, 4, 12)]), [(1, 4, 4)])
    config.model_type = "siglip_vision_model"
    with pytest.raises(NotBuiltError, match="siglip_vision_model"):
        QwenVisionTower(config, TensorParallel(), torch.float32)


def _tp_rank(rank: int, world_size: int, port: int, ref_path: str, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=120):
        reference = torch.load(ref_path)
        out = {}
        for version, (weights, pixels, grids, _) in reference.items():
            tower = _tower(version, weights, TensorParallel(rank, world_size))
            with torch.inference_mode():
                out[version] = {"features": tower(pixels, grids),
                                "params": {name: p.clone() for name, p in tower.named_parameters()}}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _shard(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """What rank ``rank`` of two should hold of checkpoint tensor ``name``."""
    if ".qkv." in name:  # each of q, k, v split by heads
        return torch.cat([part.chunk(2, dim=0)[rank] for part in full.chunk(3, dim=0)])
    column = (".fc1.", ".gate_proj.", ".up_proj.", "merger.mlp.0.")
    row = (".proj.weight", ".fc2.weight", ".down_proj.weight", "merger.mlp.2.weight")
    if any(part in name for part in column):
        return full.chunk(2, dim=0)[rank]
    if name.endswith(row) and not name.startswith("patch_embed."):
        return full.chunk(2, dim=1)[rank]
    return full


@pytest.mark.slow
def test_two_ranks_hold_their_shards_and_give_the_one_rank_output(tmp_path):
    reference = {}
    for version, grids in (("2", GRIDS["two images"]), ("2.5", GRIDS["partial windows and a clip"])):
        weights, pixels = _hf_tower(version).state_dict(), _pixels(grids)
        with torch.no_grad():
            reference[version] = (weights, pixels, grids, _tower(version, weights)(pixels, grids))
    torch.save(reference, tmp_path / "ref.pt")
    spawn_ranks(_tp_rank, (2, free_port(), str(tmp_path / "ref.pt"), str(tmp_path)))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for version, (weights, _, _, expected) in reference.items():
            params = got[version]["params"]
            assert params.keys() == weights.keys()
            for name, param in params.items():
                assert torch.equal(param, _shard(name, weights[name], rank)), (version, name)
            assert params["blocks.0.attn.qkv.weight"].shape[0] == 3 * weights["blocks.0.attn.qkv.weight"].shape[1] // 2
            torch.testing.assert_close(got[version]["features"], expected, **FP32_TOLERANCE)
