"""A pre-quantized checkpoint tensor one row or column larger than config.json makes it (qweight, qzeros, scales,
g_idx, weight_scale_inv, weight_packed, weight_zero_point, weight_scale) is a ConfigError naming it, as a float
weight's is (tests/unit/test_loader.py): the loaders cut each rank's slice from it, and without checking the whole
tensor first they loaded it cut short and served wrong weights silently."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors_reference import int_weights, write_ct_checkpoint, write_ct_fp8_experts, write_ct_int_experts
from fp8_checkpoint_reference import write_fp8_checkpoint
from int4_reference import write_int4_checkpoint
from safetensors.torch import load_file, save_file

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.models.loader import load_hf_config, load_model

CPU = torch.device("cpu")
WRITERS = {
    "awq": lambda src, dst: write_int4_checkpoint(src, dst, "awq", 16),
    "gptq-act-order": lambda src, dst: write_int4_checkpoint(src, dst, "gptq", 16, 4, True),
    "fp8-block": lambda src, dst: write_fp8_checkpoint(src, dst, (16, 16)),
    "ct-w4a16-asym": lambda src, dst: write_ct_checkpoint(src, dst, {"g": int_weights(4, 16, False)}),
    # Qwen3-MoE's experts (asyncllm/models/fp8_experts.py, int4_experts.py, compressed_tensors_experts.py)
    "moe-fp8-block": lambda src, dst: write_fp8_checkpoint(src, dst, (16, 16), ("lm_head",)),
    "moe-gptq-act-order": lambda src, dst: write_int4_checkpoint(src, dst, "gptq", 16, 4, True),
    "moe-ct-w4a16-asym": lambda src, dst: write_ct_int_experts(src, dst, 4, 16, False),
    "moe-ct-fp8-channel": lambda src, dst: write_ct_fp8_experts(src, dst, "channel"),
}
CASES = [  # format, tensor, dimension grown by one
    ("awq", "model.layers.1.self_attn.k_proj.qweight", 1),  # packed output columns (fused in qkv_proj)
    ("awq", "model.layers.1.mlp.down_proj.qweight", 0),  # input rows (row-parallel)
    ("awq", "model.layers.1.self_attn.k_proj.scales", 1),
    ("awq", "model.layers.1.self_attn.k_proj.qzeros", 1),
    ("gptq-act-order", "model.layers.1.mlp.down_proj.qweight", 0),
    ("gptq-act-order", "model.layers.1.mlp.down_proj.g_idx", 0),
    ("gptq-act-order", "model.layers.1.self_attn.k_proj.scales", 1),
    ("fp8-block", "model.layers.1.self_attn.k_proj.weight_scale_inv", 0),
    ("fp8-block", "model.layers.1.mlp.down_proj.weight_scale_inv", 1),
    ("ct-w4a16-asym", "model.layers.1.self_attn.k_proj.weight_packed", 0),
    ("ct-w4a16-asym", "model.layers.1.mlp.down_proj.weight_packed", 1),
    ("ct-w4a16-asym", "model.layers.1.self_attn.k_proj.weight_zero_point", 0),
    ("ct-w4a16-asym", "model.layers.1.mlp.down_proj.weight_scale", 1),
    ("moe-fp8-block", "model.layers.1.mlp.experts.1.gate_proj.weight_scale_inv", 0),
    ("moe-fp8-block", "model.layers.1.mlp.experts.1.down_proj.weight_scale_inv", 1),
    ("moe-gptq-act-order", "model.layers.1.mlp.experts.1.up_proj.qweight", 1),
    ("moe-gptq-act-order", "model.layers.1.mlp.experts.1.down_proj.g_idx", 0),
    ("moe-ct-w4a16-asym", "model.layers.1.mlp.experts.1.gate_proj.weight_zero_point", 0),
    ("moe-ct-w4a16-asym", "model.layers.1.mlp.experts.1.down_proj.weight_packed", 1),
    ("moe-ct-fp8-channel", "model.layers.1.mlp.experts.1.up_proj.weight_scale", 0),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from asyncllm.tiny import tiny_checkpoint

    folder = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, write in WRITERS.items():
        write(tiny_checkpoint("qwen3_moe" if name.startswith("moe-") else "llama"), folder / name)
        out[name] = folder / name
    return out


@pytest.mark.parametrize("fmt, tensor, dim", CASES, ids=[f"{c[0]}-{c[1].split('layers.1.')[1]}" for c in CASES])
def test_a_quantized_tensor_larger_than_the_config_is_refused_by_name(checkpoints, tmp_path, fmt, tensor, dim):
    path = tmp_path / fmt
    shutil.copytree(checkpoints[fmt], path)
    tensors = load_file(str(path / "model.safetensors"))
    grown = list(tensors[tensor].shape)
    grown[dim] += 1
    tensors[tensor] = torch.zeros(grown, dtype=tensors[tensor].dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"{tensor}.*has shape \({grown[0]}, {grown[1]}\)" if len(grown) == 2
                       else rf"{tensor}.*has shape \({grown[0]},\)"):
        load_model(EngineConfig.create(str(path)), load_hf_config(str(path)), CPU, torch.float32)
