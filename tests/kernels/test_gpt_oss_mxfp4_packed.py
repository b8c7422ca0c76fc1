"""gpt-oss's MXFP4 experts kept packed on the Triton backend (asyncllm/models/mxfp4_experts.py): each rank holds the
checkpoint's own bytes and exponents (its experts, its rows of gate and up, its columns of down), which dequantize to
exactly what the torch_sdpa backend's load dequantizes; the model's logits through the fused-MoE kernel's MXFP4 path
(interpreted) match transformers'; a split through a group, dummy weights and ``quantization="mxfp4"``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint
from kernel_testing import DEVICE
from mxfp4_utils import mxfp4_checkpoints

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.gpt_oss import GptOssForCausalLM
from asyncllm.models.layers import TensorParallel
from asyncllm.models.loader import checkpoint_files, iterate_safetensors, load_hf_config, load_model
from asyncllm.models.mxfp4 import dequantize_mxfp4
from asyncllm.models.mxfp4_experts import DUMMY_SCALE
from asyncllm.tiny import tiny_checkpoint



@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return mxfp4_checkpoints(tmp_path_factory.mktemp("mxfp4"))


def _build(path: str, backend: str, rank: int = 0, tp_size: int = 1, expert_parallel: bool = False
           ) -> GptOssForCausalLM:
    """Rank ``rank`` of ``tp_size`` (no process group: its experts are only looked at), loaded from ``path``."""
    with torch.device(DEVICE):
        model = GptOssForCausalLM(load_hf_config(path), dtype=torch.float32, tp=TensorParallel(rank, tp_size),
                                  attn_backend=get_attention_backend(backend, DEVICE, torch.float32), max_position=64,
                                  expert_parallel=expert_parallel)
    assert model.load_weights(iterate_safetensors(checkpoint_files(path))) == model.checkpoint_weight_names()
    return model


def _dequantized(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed layer's ``w13`` / ``w2`` dequantized as the load dequantizes them."""
    return tuple(dequantize_mxfp4(getattr(experts, f"{n}_weight").view(*scales.shape, 16), scales, torch.float32)
                 for n, scales in (("w13", experts.w13_scales), ("w2", experts.w2_scales)))


@pytest.mark.parametrize("rank, tp_size, expert_parallel", [(0, 1, False), (1, 2, False), (1, 2, True),
                                                            (3, 4, False)])
def test_packed_rank_holds_what_the_dequantized_load_holds(checkpoints, rank: int, tp_size: int,
                                                            expert_parallel: bool) -> None:
    path, _ = checkpoints
    packed = _build(path, "triton", rank, tp_size, expert_parallel)
    floats = _build(path, "torch_sdpa", rank, tp_size, expert_parallel)
    assert packed.mxfp4_packed and not floats.mxfp4_packed
    assert "model.layers.1.mlp.experts.gate_up_proj_scales" in packed.checkpoint_weight_names()
    for layer in (0, 1):
        ours, theirs = packed.model.layers[layer].mlp.experts, floats.model.layers[layer].mlp.experts
        assert ours.w13_weight.dtype == torch.uint8 and ours.w13_scales.dtype == torch.uint8
        assert ours.w13_weight.shape[-1] == 32 and ours.w2_weight.shape[-1] == ours.intermediate // 2  # H = 64
        w13, w2 = _dequantized(ours)
        assert torch.equal(w13, theirs.w13_weight) and torch.equal(w2, theirs.w2_weight), layer
        assert torch.equal(ours.w13_bias, theirs.w13_bias) and torch.equal(ours.w2_bias, theirs.w2_bias)


def test_packed_logits_match_transformers(checkpoints) -> None:
    """The whole model on the Triton backend (the kernels interpreted), experts packed: transformers' logits."""
    path, _ = checkpoints
    model = load_model(EngineConfig.create(path, attention_backend="triton"), load_hf_config(path), DEVICE, torch.float32)
    assert model.mxfp4_packed
    with torch.device(DEVICE):  # the driver's step tensors on the model's device
        assert_paged_logits_match_checkpoint(model, path, [9, 14], [[5, 9], [3, 4], [1, 1]], seed=3, atol=1e-4)


def test_a_split_through_a_group_dequantizes(checkpoints, caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of 64 (as if) over 4 ranks of 32 intermediate rows each: a rank's split cuts a group, so its experts are
    dequantized at load (logged) and equal the torch_sdpa load's."""
    path, _ = checkpoints
    monkeypatch.setattr("asyncllm.models.mxfp4_experts.MXFP4_GROUP", 64)
    with caplog.at_level(logging.INFO, logger="asyncllm.models.gpt_oss"):
        model = _build(path, "triton", 3, 4)
    assert not model.mxfp4_packed and "not whole groups of 64" in caplog.text
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(experts.w13_weight, _build(path, "torch_sdpa", 3, 4).model.layers[0].mlp.experts.w13_weight)


def test_dummy_packed_experts(checkpoints) -> None:
    path, _ = checkpoints
    config = EngineConfig.create(path, attention_backend="triton", load_format="dummy", seed=4)
    experts = load_model(config, load_hf_config(path), DEVICE, torch.float32).model.layers[1].mlp.experts
    assert experts.packed and bool((experts.w2_scales == DUMMY_SCALE).all())
    assert len(torch.unique(experts.w13_weight)) > 200  # random bytes: every nibble value
    w13, _ = _dequantized(experts)
    assert 0.015 < float(w13.std()) < 0.03  # near the float dummy weights' 0.02


def test_quantization_mxfp4_names_the_checkpoint_method(checkpoints) -> None:
    path, _ = checkpoints
    hf_config = load_hf_config(path)
    assert prequantized_config(hf_config, path, "mxfp4") is None  # vLLM's name for it: served as with None
    model = load_model(EngineConfig.create(path, quantization="mxfp4", attention_backend="triton"), hf_config, DEVICE,
                       torch.float32)
    assert model.mxfp4_packed
    with pytest.raises(ConfigError, match="'mxfp4' serves checkpoints pre-quantized with it"):
        prequantized_config(load_hf_config(tiny_checkpoint("gpt_oss")), "gpt-oss", "mxfp4")


def test_a_float_tensor_for_packed_experts_is_refused(checkpoints, tmp_path: Path) -> None:
    path, float_path = checkpoints
    model = _build(path, "triton")
    weights = dict(iterate_safetensors(checkpoint_files(float_path)))
    name = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(ValueError, match="float down matrix; this model's experts are MXFP4"):
        model.load_weights([(name, weights[name])])


def test_dummy_weights_refuse_integer_parameters_nobody_draws() -> None:
    """A packed (integer) parameter is drawn by its module's ``draw_dummy``; one no module draws is an error, not
    uninitialised memory."""
    from asyncllm.models.loader import init_dummy_weights

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(4, 4)
    model.proj.register_parameter("packed", torch.nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False))
    with pytest.raises(RuntimeError, match=r"integer parameters \['proj.packed'\] have no module drawing them"):
        init_dummy_weights(model, seed=0)
