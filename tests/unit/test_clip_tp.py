"""The LLaVA vision encoder sharded over two gloo ranks (mm_encoder_tp_mode="weights") and kept whole ("data")."""

from __future__ import annotations

import os

import pytest
import torch
from model_utils import free_port, gloo_rank, spawn_ranks
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.llava import LlavaForConditionalGeneration
from asyncllm.models.loader import load_model

FP32_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
"""Sharded vs whole encoder in float32: only the row-parallel sums' rounding order differs."""

# vision: hidden 48 = 6 heads x 8, MLP 80; projector 48 -> 64 (the text hidden size)
SHARDED_SHAPES = {  # one rank's shard at TP=2
    "q_proj.weight": (24, 48), "q_proj.bias": (24,), "k_proj.weight": (24, 48), "k_proj.bias": (24,),
    "v_proj.weight": (24, 48), "v_proj.bias": (24,), "out_proj.weight": (48, 24), "out_proj.bias": (48,),
    "fc1.weight": (40, 48), "fc1.bias": (40,), "fc2.weight": (48, 40), "fc2.bias": (48,),
    "linear_1.weight": (32, 48), "linear_1.bias": (32,), "linear_2.weight": (64, 32), "linear_2.bias": (64,),
}
WHOLE_SHAPES = {
    "q_proj.weight": (48, 48), "out_proj.weight": (48, 48), "fc1.weight": (80, 48), "fc2.weight": (48, 80),
    "linear_1.weight": (64, 48), "linear_2.weight": (64, 64),
}
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "fc1", "linear_1")
"""Split by output rows (q/k/v by heads): rank r holds rows [r * n/2, (r + 1) * n/2) of weight and bias."""
ROW_PARALLEL = ("out_proj", "fc2", "linear_2")
"""Split by input columns: rank r holds columns [r * n/2, (r + 1) * n/2); the bias is whole."""


def _config(vision_heads: int = 6) -> LlavaConfig:
    vision = CLIPVisionConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=vision_heads,
                              image_size=32, patch_size=8, projection_dim=48)
    text = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=63, vision_feature_layer=-2,
                       vision_feature_select_strategy="default", architectures=["LlavaForConditionalGeneration"])


def _build(tp: TensorParallel, mode: str = "weights", vision_heads: int = 6) -> LlavaForConditionalGeneration:
    backend = get_attention_backend(None, torch.device("cpu"), torch.float32)
    return LlavaForConditionalGeneration(_config(vision_heads), dtype=torch.float32, tp=tp, attn_backend=backend,
                                         max_position=128, mm_encoder_tp_mode=mode).eval()


def _encoder_shapes(model: LlavaForConditionalGeneration) -> dict[str, tuple[int, ...]]:
    """Layer 0's attention and MLP parameters and the projector's, by short name."""
    layer = model.vision_tower.encoder.layers[0]
    modules = (layer.self_attn, layer.mlp, model.multi_modal_projector)
    return {name: tuple(p.shape) for m in modules for name, p in m.named_parameters()}


def _reference(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A whole (TP=1) model's random encoder weights, three images, and its features for them."""
    model = _build(TensorParallel())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        pixels = torch.randn(3, 3, 32, 32, generator=generator)
        encoder = {k: v for k, v in model.state_dict().items() if not k.startswith("language_model.")}
        return encoder, pixels, model.embed_multimodal(pixels)


def _tp_rank(rank: int, world_size: int, port: int, ref_path: str, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=120):
        weights, pixels, _ = torch.load(ref_path)
        out = {}
        for mode in ("weights", "data"):
            model = _build(TensorParallel(rank, world_size), mode)
            model.load_weights(weights.items())
            with torch.inference_mode():
                features = model.embed_multimodal(pixels)
            out[mode] = {"features": features, "shapes": _encoder_shapes(model),
                         "params": {k: v.clone() for k, v in model.state_dict().items() if k in weights}}
            config = EngineConfig.create("m", load_format="dummy", mm_encoder_tp_mode=mode)
            loaded = load_model(config, _config(), torch.device("cpu"), torch.float32, rank, world_size)
            out[mode]["loader_shapes"] = _encoder_shapes(loaded)  # the worker's path passes the mode on
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _shard(full: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    """What rank ``rank`` of two should hold of checkpoint tensor ``name``."""
    module = name.rsplit(".", 2)[-2]
    if module in COLUMN_PARALLEL:
        return full.chunk(2, dim=0)[rank]
    if module in ROW_PARALLEL and name.endswith("weight"):
        return full.chunk(2, dim=1)[rank]
    return full


@pytest.mark.slow
def test_weights_mode_shards_the_tower_and_projector_and_gives_the_whole_towers_features(tmp_path):
    weights, pixels, expected = _reference()
    torch.save((weights, pixels, expected), tmp_path / "ref.pt")
    spawn_ranks(_tp_rank, (2, free_port(), str(tmp_path / "ref.pt"), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for rank, got in enumerate(ranks):
        sharded, whole = got["weights"], got["data"]
        assert sharded["shapes"] == sharded["loader_shapes"] == SHARDED_SHAPES  # half the rows / columns
        assert whole["shapes"] == whole["loader_shapes"]
        assert all(whole["shapes"][name] == shape for name, shape in WHOLE_SHAPES.items())
        for name, param in sharded["params"].items():
            assert torch.equal(param, _shard(weights[name], name, rank)), name
        assert all(torch.equal(param, weights[name]) for name, param in whole["params"].items())
        assert expected.shape == (3, 16, 64)  # 4x4 patches (CLS dropped) x text hidden
        assert sharded["params"].keys() == whole["params"].keys() == weights.keys()
        torch.testing.assert_close(sharded["features"], expected, **FP32_TOLERANCE)
        torch.testing.assert_close(whole["features"], expected, **FP32_TOLERANCE)


def test_weights_mode_refuses_vision_heads_that_do_not_split_and_data_mode_keeps_the_encoder_whole():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 .*vision_config.num_attention_heads=6") as info:
        _build(TensorParallel(0, 4))
    assert info.value.field == "tensor_parallel_size"
    assert "vision_config.intermediate_size" not in str(info.value)  # 80 splits over 4: only the heads are named
    whole = _build(TensorParallel(1, 2), "data")  # no collectives at build time: no process group needed
    assert whole.encoder_tp == TensorParallel() and _encoder_shapes(whole)["q_proj.weight"] == (48, 48)
    sharded = _build(TensorParallel(1, 2))
    assert sharded.encoder_tp == TensorParallel(1, 2) and _encoder_shapes(sharded) == SHARDED_SHAPES
    with pytest.raises(ConfigError, match="mm_encoder_tp_mode='both'"):
        _build(TensorParallel(), "both")
