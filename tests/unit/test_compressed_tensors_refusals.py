"""What is refused when a compressed-tensors checkpoint is loaded (asyncllm/models/compressed_tensors.py): a tensor
parallel split through an int pack, a group or an fp8 block, fused projections with different schemes, a wrong
``weight_shape``; the loading itself is in tests/unit/test_compressed_tensors.py."""

from __future__ import annotations

import pytest
import torch
from model_utils import tiny_hf_config

from asyncllm.attention.selector import get_attention_backend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.compressed_tensors import _quantize_drawn, make_compressed_tensors_params
from asyncllm.models.compressed_tensors_config import CompressedTensorsCheckpointConfig, CompressedTensorsScheme
from asyncllm.models.layers import TensorParallel
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.loader import load_hf_config
import test_compressed_tensors
from test_compressed_tensors import CPU

checkpoint = test_compressed_tensors.checkpoint  # the module's fixture, shared


def _model(tp: TensorParallel, **overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(tiny_hf_config("llama", **overrides), dtype=torch.float32, tp=tp,
                            attn_backend=get_attention_backend(None, CPU, torch.float32), max_position=128)


def _config(scheme: CompressedTensorsScheme, *more: tuple[tuple[str, ...], CompressedTensorsScheme]):
    return CompressedTensorsCheckpointConfig(((("Linear",), scheme),) + more, ("lm_head",))


W4_ASYM = CompressedTensorsScheme("int", "group", 4, 16, symmetric=False)


@pytest.mark.parametrize("cfg, overrides, layer, what", [
    (_config(W4_ASYM), dict(num_attention_heads=16), "model.layers.0.self_attn.qkv_proj",
     "[32, 4, 4] output features"),  # head_dim 4: a rank's KV head is half an int32 of zero points
    (_config(CompressedTensorsScheme("int", "group", 4, 64)), {}, "model.layers.0.self_attn.o_proj",
     "32 input features per rank, not a multiple of the 8 4-bit values packed in an int32 and of the group_size 64"),
])
def test_a_split_through_a_pack_or_a_group_is_refused(cfg, overrides: dict, layer: str, what: str) -> None:
    with pytest.raises(ConfigError, match="split on whole packs and groups") as info:
        make_compressed_tensors_params(_model(TensorParallel(0, 2), **overrides), cfg)
    assert layer in str(info.value) and what in str(info.value), str(info.value)
    assert info.value.field == "tensor_parallel_size" and not isinstance(info.value, NotBuiltError)


@pytest.mark.parametrize("tp, block, layer, what", [
    (2, (32, 32), "model.layers.0.self_attn.qkv_proj", "[32, 16, 16] output rows"),  # a rank's k: half a block
    (1, (64, 16), "model.layers.0.self_attn.qkv_proj", "[64, 32, 32] output rows"),  # k and v in one block of rows
    (2, (16, 48), "model.layers.0.self_attn.o_proj", "[32] input features"),
])
def test_a_split_through_an_fp8_block_is_refused(tp: int, block: tuple[int, int], layer: str, what: str) -> None:
    """As for ``quant_method: fp8`` checkpoints (vLLM's validate_fp8_block_shape), at load and with dummy weights."""
    cfg = _config(CompressedTensorsScheme("fp8", "block", block=block))
    for build in (make_compressed_tensors_params, lambda model, cfg: _quantize_drawn(model, cfg, False)):
        with pytest.raises(ConfigError, match="a split on whole fp8 weight blocks") as info:
            build(_model(TensorParallel(0, tp)), cfg)
        assert layer in str(info.value) and what in str(info.value) and f"block_structure {list(block)}" in \
            str(info.value), str(info.value)
        assert info.value.field == "tensor_parallel_size" and not isinstance(info.value, NotBuiltError)


def test_fused_projections_with_different_schemes_are_refused() -> None:
    fp8 = CompressedTensorsScheme("fp8", "channel")
    cfg = _config(fp8, (("model.layers.0.self_attn.k_proj",), W4_ASYM))
    with pytest.raises(ConfigError, match="one compressed-tensors scheme for all the projections fused in "
                                          "model.layers.0.self_attn.qkv_proj"):
        make_compressed_tensors_params(_model(TensorParallel(0, 1)), cfg)


def test_a_wrong_weight_shape_is_refused(checkpoint) -> None:
    from safetensors.torch import load_file

    path, _ = checkpoint("w4a16-asym-g16")
    tensors = load_file(f"{path}/model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([64, 96])
    model = _model(TensorParallel(0, 1), intermediate_size=128)
    make_compressed_tensors_params(model, prequantized_config(load_hf_config(path), path, None))
    with pytest.raises(ConfigError, match="down_proj.weight_shape.* is \\[64, 96\\], a weight_shape of 128 input"):
        model.load_weights(tensors.items())
