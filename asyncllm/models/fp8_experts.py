"""Fp8 experts of pre-quantized fp8 mixture-of-experts checkpoints, beside the dense layers of
asyncllm/models/fp8_checkpoint.py: block-wise (Qwen3-30B-A3B-FP8, Qwen3.5-MoE's FP8 releases, ...) or per tensor
(Mixtral-8x7B-Instruct-v0.1-FP8 with ``activation_scheme: "dynamic"``, Qwen MoE FP8 made without
``weight_block_size``).

Each `FusedMoE` whose experts the checkpoint quantized gets float8_e4m3fn ``w13_weight`` / ``w2_weight`` (filled
per expert as the float matrices are: the gate's rows, then the up's, this rank's part) and computes with the
fused-MoE op's `reference.Fp8Experts` (docs/moe.md): block scales ``w13_weight_scale_inv [E, rows / bn,
ceil(H / bk)]`` and ``w2_weight_scale_inv [E, ceil(H / bn), ceil(I / bk)]``, each expert's inputs quantized per
token in groups of ``bk``.

- **Block-wise**: the block scales are the checkpoint's (``experts.N.gate_proj.weight_scale_inv`` ...), filled
  per expert. The gate and up rows meet on a block boundary (the intermediate size a multiple of ``bn``), and a
  tensor-parallel split of the intermediate size falls on whole blocks; otherwise `ConfigError`.
- **Per tensor**: a scalar ``weight_scale`` per expert matrix is a block scale whose block covers the matrix, so
  the scalars load into staging parameters (``gate_weight_scale`` ... ``[E]``, the names the checkpoint's map to)
  and `finish_fp8_expert_params` makes each the scale of an ``(I, K)`` block (``I`` this rank's intermediate
  rows, ``K`` all of a product's inputs: `whole_row_group`): ``w13`` gets two block rows (the gate's scale, then
  the up's: they stay apart, nothing is requantized), ``w2`` its down scale on every block row. Exact for any
  intermediate size and any tensor-parallel split. The inputs are quantized per token, one scale per token (as
  the dense per-tensor layers'; vLLM's per-tensor experts: one per tensor); under a split the down product's
  input is this rank's intermediate columns.

Static activation scales (``activation_scheme: "static"``, AutoFP8's per-tensor checkpoints:
Mixtral-8x7B-Instruct-v0.1-FP8): each expert matrix's scalar ``input_scale`` loads into a staging parameter
(``gate_input_scale`` ... ``[E]``, as the weight scales), and `attach_input_scales` keeps one per product, as vLLM's
``Fp8MoEMethod`` does: ``w13_input_scale`` the largest of this rank's experts' gate and up scales, ``w2_input_scale``
the largest down scale (a warning when the experts' differ). Each product's input is then quantized with it,
``fp8(clamp(x / s, -448, 448))`` for every token (`reference.static_quant_fp8`, the dense static layers'
arithmetic). Static scales over block-wise weights are refused when the config is read (checkpoint.py, as vLLM).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from asyncllm.errors import ConfigError
from asyncllm.kernels import reference
from asyncllm.models.checkpoint import Fp8CheckpointConfig
from asyncllm.models.fp8_checkpoint import DUMMY_INPUT_SCALE, quantize_fp8_blocks
from asyncllm.models.layers import LoadedWeight, check_whole_size, copy_weight, new_param, scalar_weight, weight_narrow
from asyncllm.models.moe import FusedMoE
from asyncllm.models.quantization import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_fp8, scaled_mm_supported

logger = logging.getLogger("asyncllm.models")

__all__ = ["fp8_expert_layers", "make_fp8_expert_params", "finish_fp8_expert_params", "quantize_drawn_experts",
           "whole_row_group", "check_blocks", "fp8_weights", "compute_in_fp8", "attach_tensor_scales",
           "quantize_per_matrix", "pop_staged_scales", "make_input_scale_params", "attach_input_scales"]
# from whole_row_group on: compressed-tensors' and online fp8's too


def whole_row_group(moe: FusedMoE) -> int:
    """The columns of a block of experts scaled per row or per matrix: all of both products' inputs (``w13``'s H,
    ``w2``'s intermediate columns on this rank), so a weight row (or block row) has one scale and each token's
    input one (the fused-MoE kernel walks such a group 128 columns a step)."""
    return max(moe.w13_weight.shape[2], moe.w2_weight.shape[2])


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
    """Before loading: fp8 weights and block scale parameters (per tensor: scalar staging parameters) for the
    quantized experts; returns how many layers."""
    block = cfg.weight_block_size
    layers = fp8_expert_layers(model, cfg)
    for name, moe in layers:
        if block is None:
            _make_tensor_scale_params(moe)
            if cfg.static_input:
                make_input_scale_params(moe)
        else:
            check_blocks(name, moe, block)
            _make_params(moe, block)
    return len(layers)


def check_blocks(name: str, moe: FusedMoE, block: tuple[int, int]) -> None:
    split = not moe.expert_parallel and moe.tp.size > 1
    bn, bk = block
    if (moe.gated or split) and moe.intermediate % bn or split and moe.intermediate % bk:
        raise ConfigError("tensor_parallel_size", moe.tp.size,
                          f"fp8 expert blocks {list(block)} whole on each rank: {name} holds {moe.intermediate} "
                          "intermediate rows per expert, which the gate and up (and a rank's split) must cut on "
                          "block boundaries")


def fp8_weights(moe: FusedMoE, dtype: torch.dtype = FP8_DTYPE) -> None:
    """The experts' ``w13`` / ``w2`` as empty fp8 parameters (``dtype`` int8: compressed-tensors' W8A8 int8 experts)
    loaded as the float ones."""
    w13, w2 = moe.w13_weight, moe.w2_weight
    with torch.device(w13.device):
        moe.w13_weight = new_param(*w13.shape, dtype=dtype, loader=moe.weight_loader)
        moe.w2_weight = new_param(*w2.shape, dtype=dtype, loader=moe.weight_loader)


def _make_params(moe: FusedMoE, block: tuple[int, int]) -> None:
    (bn, bk), loader = block, functools.partial(_load_scales, moe, block)
    fp8_weights(moe)
    w13, w2 = moe.w13_weight, moe.w2_weight
    with torch.device(w13.device):
        moe.w13_weight_scale_inv = new_param(w13.shape[0], -(-w13.shape[1] // bn), -(-w13.shape[2] // bk),
                                             dtype=torch.float32, loader=loader)
        moe.w2_weight_scale_inv = new_param(w2.shape[0], -(-w2.shape[1] // bn), -(-w2.shape[2] // bk),
                                            dtype=torch.float32, loader=loader)


def compute_in_fp8(moe: FusedMoE, block: tuple[int, int]) -> None:
    """The experts compute with their block scales: the backend's op, or on a GPU without fp8 (before Ada; int8
    experts: without int8 tensor-core dots in Triton, before Ampere) the reference's dequantizing one (as the dense
    layers' fallback)."""
    moe.fp8_block = block
    device = moe.w13_weight.device
    if device.type != "cuda":
        return
    int8 = moe.w13_weight.dtype == torch.int8
    if not (torch.cuda.get_device_capability(device) >= (8, 0) if int8 else scaled_mm_supported(device)):
        moe.fused_moe = reference.fused_moe


def _load_scales(moe: FusedMoE, block: tuple[int, int], param: nn.Parameter, loaded: LoadedWeight,
                 shard_id: tuple[int, str]) -> None:
    """One expert's gate, up or down block scales: this rank's block rows (gate, up) or block columns (down), the
    whole tensor's checked first (a larger one would load cut short)."""
    expert, part = shard_id
    (bn, bk), dst = block, param.data[expert - moe.expert_start]
    inter, start = moe.intermediate, moe.intermediate_start
    check_whole_size(loaded, 1 if part == "down" else 0, -(-moe.whole_intermediate // (bk if part == "down" else bn)))
    if part == "down":
        copy_weight(dst, weight_narrow(loaded, 1, start // bk, dst.shape[1]))
    else:
        rows = -(-inter // bn)
        offset = rows if part == "up" and moe.gated else 0
        copy_weight(dst.narrow(0, offset, rows), weight_narrow(loaded, 0, start // bn, rows))


# ---------------------------------------------------------------- per-tensor scales
def _make_tensor_scale_params(moe: FusedMoE) -> None:
    """fp8 weights and one float32 scalar per local expert and matrix (``gate_weight_scale`` ...)."""
    fp8_weights(moe)
    with torch.device(moe.w13_weight.device):
        for part in moe.parts:
            setattr(moe, f"{part}_weight_scale", new_param(moe.num_local_experts, dtype=torch.float32,
                                                           loader=functools.partial(_load_tensor_scale, moe)))


def _load_tensor_scale(moe: FusedMoE, param: nn.Parameter, loaded: LoadedWeight, shard_id: tuple[int, str]) -> None:
    """One expert matrix's scalar ``weight_scale`` (every rank reads it whole)."""
    param.data[shard_id[0] - moe.expert_start] = scalar_weight(loaded)


def finish_fp8_expert_params(model: nn.Module, cfg: Fp8CheckpointConfig) -> None:
    """After loading: block-wise experts compute in fp8 (decided on the weights' device, which before loading may be
    the meta device: loader.materialize_params); per-tensor experts' scalars repeated into their block scales (see
    the module)."""
    for _, moe in fp8_expert_layers(model, cfg):
        if cfg.weight_block_size is not None:
            compute_in_fp8(moe, cfg.weight_block_size)
            continue
        scales = pop_staged_scales(moe)
        attach_tensor_scales(moe, torch.stack(scales[:-1], dim=1), scales[-1])
        if cfg.static_input:
            attach_input_scales(moe, pop_staged_scales(moe, "input_scale"))


def pop_staged_scales(moe: FusedMoE, kind: str = "weight_scale") -> list[torch.Tensor]:
    """The staged ``{part}_{kind}`` of each of the experts' matrices (`FusedMoE.parts`' order), removed from the
    layer."""
    scales = [getattr(moe, f"{part}_{kind}").data for part in moe.parts]
    for part in moe.parts:
        delattr(moe, f"{part}_{kind}")
    return scales


def make_input_scale_params(moe: FusedMoE) -> None:
    """Static activations: one float32 staging scalar per local expert and matrix (``gate_input_scale`` ...), each
    expert matrix's ``input_scale``."""
    with torch.device(moe.w13_weight.device):
        for part in moe.parts:
            setattr(moe, f"{part}_input_scale", new_param(moe.num_local_experts, dtype=torch.float32,
                                                          loader=functools.partial(_load_tensor_scale, moe)))


def attach_input_scales(moe: FusedMoE, scales: list[torch.Tensor]) -> None:
    """The staged input scales (`FusedMoE.parts`' order) as the experts' two static scales, vLLM's: the largest of
    the gate and up ones (one input feeds both) over this rank's experts, and the largest down one."""
    w13, w2 = torch.stack(scales[:-1]), scales[-1]
    if not (bool((w13 == w13.flatten()[0]).all()) and bool((w2 == w2[0]).all())):
        _warn_once("the experts' static fp8 input scales differ: each product's input is quantized with the largest")
    moe.w13_input_scale, moe.w2_input_scale = w13.max(), w2.max()


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def attach_tensor_scales(moe: FusedMoE, w13_scales: torch.Tensor, w2_scales: torch.Tensor) -> None:
    """``w13_scales [E, parts]`` (gate, up) and ``w2_scales [E]`` as the block scales of ``I``-row blocks over all
    of K (`whole_row_group`): each of w13's block rows one matrix, each of w2's the down's."""
    block = (moe.intermediate, whole_row_group(moe))
    for name, scales, weight in (("w13", w13_scales, moe.w13_weight), ("w2", w2_scales, moe.w2_weight)):
        shape = (weight.shape[0], -(-weight.shape[1] // block[0]), -(-weight.shape[2] // block[1]))
        blocks = scales.reshape(weight.shape[0], -1, 1).expand(shape).contiguous()
        setattr(moe, f"{name}_weight_scale_inv", nn.Parameter(blocks, requires_grad=False))
    compute_in_fp8(moe, block)


@torch.no_grad()
def quantize_per_matrix(w: torch.Tensor, matrices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, rows, cols]`` whose rows are ``matrices`` stacked ones -> (fp8, float32 ``[E, matrices]``): each
    matrix by its own ``max|matrix| / 448``."""
    parts = w.reshape(w.shape[0], matrices, -1)
    scales = (parts.abs().amax(dim=-1).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_fp8(parts, scales[..., None]).reshape(w.shape), scales


@torch.no_grad()
def quantize_drawn_experts(model: nn.Module, cfg: Fp8CheckpointConfig) -> None:
    """``load_format="dummy"``: the drawn experts quantized into the checkpoint's format (block by block, or each
    expert matrix per tensor)."""
    block = cfg.weight_block_size
    for name, moe in fp8_expert_layers(model, cfg):
        if block is None:
            w13, w13_scales = quantize_per_matrix(moe.w13_weight.data, len(moe.parts) - 1)
            w2, w2_scales = quantize_per_matrix(moe.w2_weight.data, 1)
            moe.w13_weight, moe.w2_weight = (nn.Parameter(w, requires_grad=False) for w in (w13, w2))
            attach_tensor_scales(moe, w13_scales, w2_scales)
            if cfg.static_input:
                moe.w13_input_scale, moe.w2_input_scale = (torch.tensor(DUMMY_INPUT_SCALE, device=w13.device)
                                                           for _ in range(2))
            continue
        check_blocks(name, moe, block)
        for attr in ("w13_weight", "w2_weight"):
            parts = [quantize_fp8_blocks(w, block) for w in getattr(moe, attr).data]
            setattr(moe, attr, nn.Parameter(torch.stack([q for q, _ in parts]), requires_grad=False))
            setattr(moe, f"{attr}_scale_inv", nn.Parameter(torch.stack([s for _, s in parts]), requires_grad=False))
        compute_in_fp8(moe, block)
