"""MXFP4 test checkpoints: the tiny gpt-oss with its experts in MXFP4, and its float twin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from asyncllm.tiny import tiny_checkpoint


def mxfp4_checkpoints(root: Path) -> tuple[str, str]:
    """(an MXFP4 checkpoint, its float twin): the tiny checkpoint with its experts' matrices replaced by random MXFP4
    blocks and scales (exponents -8 to -4, so the weights stay the tiny model's size) and gpt-oss's
    quantization_config; the twin holds transformers' dequantization of them (`convert_moe_packed_tensors`)."""
    src = tiny_checkpoint("gpt_oss")
    paths = root / "mxfp4", root / "float"
    for path in paths:
        shutil.copytree(src, path)
    state = load_file(f"{src}/model.safetensors")
    quantized, dequantized = dict(state), dict(state)
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = quantized.pop(name).shape  # transformers' [E, in, out]
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(119, 124, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
        quantized.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    for path, weights in zip(paths, (quantized, dequantized)):
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((paths[0] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (paths[0] / "config.json").write_text(json.dumps(config))
    return str(paths[0]), str(paths[1])
