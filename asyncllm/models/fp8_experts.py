"""Block-fp8 experts of pre-quantized fp8 mixture-of-experts checkpoints (Qwen3-30B-A3B-FP8, Qwen3.5-MoE's FP8
releases, ...), beside the dense layers of asyncllm/models/fp8_checkpoint.py.

Each `FusedMoE` whose experts the checkpoint quantized gets float8_e4m3fn ``w13_weight`` / ``w2_weight`` and their
block scales ``w13_weight_scale_inv [E, rows / bn, ceil(H / bk)]`` and ``w2_weight_scale_inv [E, ceil(H / bn),
I / bk]``, filled per expert (``experts.N.gate_proj.weight_scale_inv`` ...) as the matrices are: the gate's block
rows, then the up's, this rank's part. The gate and up rows meet on a block boundary (the intermediate size a
multiple of ``bn``), and a tensor-parallel split of the intermediate size falls on whole blocks; otherwise
`ConfigError`. The product is the fused-MoE op's with `reference.Fp8Experts` (docs/moe.md). Per-tensor fp8
experts are not built.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.checkpoint import Fp8CheckpointConfig
from asyncllm.models.fp8_checkpoint import quantize_fp8_blocks
from asyncllm.models.layers import LoadedWeight, copy_weight, new_param, weight_narrow
from asyncllm.models.moe import FusedMoE
from asyncllm.models.quantization import FP8_DTYPE, scaled_mm_supported

__all__ = ["fp8_expert_layers", "make_fp8_expert_params", "quantize_drawn_experts"]


def fp8_expert_layers(model: nn.Module, cfg: Fp8CheckpointConfig) -> list[tuple[str, FusedMoE]]:
    """(name, experts) of every `FusedMoE` the checkpoint quantized (none of its expert matrices ignored)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            checkpoint_names = [ckpt for ckpt, _ in model._unpacked(f"{name}.w13_weight")]  # type: ignore[operator]
            ignored = [cfg.is_ignored(ckpt.removesuffix(".weight")) for ckpt in checkpoint_names]
            if any(ignored) and not all(ignored):
                raise ConfigError("model", name, "a quantization_config that ignores all of a layer's experts or "
                                                 "none of them")
            if not any(ignored):
                found.append((name, module))
    return found


def make_fp8_expert_params(model: nn.Module, cfg: Fp8CheckpointConfig) -> int:
    """Before loading: fp8 weights and block scale parameters for the quantized experts; returns how many layers."""
    block = cfg.weight_block_size
    layers = fp8_expert_layers(model, cfg)
    if layers and block is None:
        raise NotBuiltError("model", layers[0][0], "per-tensor fp8 experts (block-wise fp8 experts are served)")
    for name, moe in layers:
        _check_blocks(name, moe, block)  # type: ignore[arg-type]
        _make_params(moe, block)  # type: ignore[arg-type]
    return len(layers)


def _check_blocks(name: str, moe: FusedMoE, block: tuple[int, int]) -> None:
    split = not moe.expert_parallel and moe.tp.size > 1
    bn, bk = block
    if (moe.gated or split) and moe.intermediate % bn or split and moe.intermediate % bk:
        raise ConfigError("tensor_parallel_size", moe.tp.size,
                          f"fp8 expert blocks {list(block)} whole on each rank: {name} holds {moe.intermediate} "
                          "intermediate rows per expert, which the gate and up (and a rank's split) must cut on "
                          "block boundaries")


def _make_params(moe: FusedMoE, block: tuple[int, int]) -> None:
    (bn, bk), loader = block, functools.partial(_load_scales, moe, block)
    w13, w2 = moe.w13_weight, moe.w2_weight
    with torch.device(w13.device):
        moe.w13_weight = new_param(*w13.shape, dtype=FP8_DTYPE, loader=moe.weight_loader)
        moe.w2_weight = new_param(*w2.shape, dtype=FP8_DTYPE, loader=moe.weight_loader)
        moe.w13_weight_scale_inv = new_param(w13.shape[0], -(-w13.shape[1] // bn), -(-w13.shape[2] // bk),
                                             dtype=torch.float32, loader=loader)
        moe.w2_weight_scale_inv = new_param(w2.shape[0], -(-w2.shape[1] // bn), -(-w2.shape[2] // bk),
                                            dtype=torch.float32, loader=loader)
    _compute_in_fp8(moe, block)


def _compute_in_fp8(moe: FusedMoE, block: tuple[int, int]) -> None:
    """The experts compute with their block scales: the backend's op, or on a GPU without fp8 (before Ada) the
    reference's dequantizing one (as the dense layers' fallback)."""
    moe.fp8_block = block
    device = moe.w13_weight.device
    if device.type == "cuda" and not scaled_mm_supported(device):
        moe.fused_moe = reference.fused_moe


def _load_scales(moe: FusedMoE, block: tuple[int, int], param: nn.Parameter, loaded: LoadedWeight,
                 shard_id: tuple[int, str]) -> None:
    """One expert's gate, up or down block scales: this rank's block rows (gate, up) or block columns (down)."""
    expert, part = shard_id
    (bn, bk), dst = block, param.data[expert - moe.expert_start]
    inter, start = moe.intermediate, 0 if moe.expert_parallel else moe.tp.rank * moe.intermediate
    if part == "down":
        copy_weight(dst, weight_narrow(loaded, 1, start // bk, dst.shape[1]))
    else:
        rows = -(-inter // bn)
        offset = rows if part == "up" and moe.gated else 0
        copy_weight(dst.narrow(0, offset, rows), weight_narrow(loaded, 0, start // bn, rows))


@torch.no_grad()
def quantize_drawn_experts(model: nn.Module, cfg: Fp8CheckpointConfig) -> None:
    """``load_format="dummy"``: the drawn experts quantized block by block into the checkpoint's format."""
    block = cfg.weight_block_size
    for name, moe in fp8_expert_layers(model, cfg):
        if block is None:
                raise NotBuiltError("model", name, "per-tensor fp8 experts (block-wise fp8 experts are served)")
        _check_blocks(name, moe, block)
        for attr in ("w13_weight", "w2_weight"):
            parts = [quantize_fp8_blocks(w, block) for w in getattr(moe, attr).data]
            setattr(moe, attr, nn.Parameter(torch.stack([q for q, _ in parts]), requires_grad=False))
            setattr(moe, f"{attr}_scale_inv", nn.Parameter(torch.stack([s for _, s in parts]), requires_grad=False))
        _compute_in_fp8(moe, block)
