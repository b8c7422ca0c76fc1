"""W8A8 experts of compressed-tensors mixture-of-experts checkpoints, fp8 (llm-compressor's FP8_DYNAMIC: RedHatAI's
Qwen3-30B-A3B-FP8-dynamic, Mixtral-8x7B-Instruct-v0.1-FP8-dynamic; per-tensor fp8 weights with dynamic
activations; FP8_BLOCK) or int8 (W8A8: RedHatAI's ``*-quantized.w8a8`` Mixtral and Qwen3-MoE releases), served on
the fused-MoE op's block-fp8 path of asyncllm/models/fp8_experts.py (int8 weights: its int8 variant).

Each expert matrix is a float8_e4m3fn or int8 ``weight`` with a ``weight_scale`` (the multiplier): one per output
row (``strategy: channel``, ``[out, 1]``), one per matrix (``tensor``) or, fp8, one per ``block_structure`` cell
(``block``). `make_ct_w8a8_expert_params` gives each quantized `FusedMoE` fp8 or int8 ``w13_weight`` /
``w2_weight`` (filled per expert as the float matrices are) and staging scales ``gate_weight_scale``,
``up_weight_scale``, ``down_weight_scale`` stacked over its local experts (this rank's rows of the gate and up, the
down's rows whole or its block columns); `finish_ct_w8a8_experts` turns them into the op's block scales
(`reference.Fp8Experts`), nothing requantized:

- **channel**: each row's scale is the scale of its ``(1, K)`` block, ``K`` all of a product's inputs
  (`fp8_experts.whole_row_group`): one float32 per row, ``[E, rows, 1]`` (the fused-MoE kernel walks the row's
  group 128 columns a step).
- **tensor**: the scalar of each matrix as the scale of an ``(I, K)`` block, as fp8_experts.py's per-tensor
  experts (``I`` this rank's intermediate rows: two block rows for w13, the gate's and the up's).
- **block**: the checkpoint's block scales as they are (the gate and up meet on a block row boundary, a
  tensor-parallel split falls on whole blocks; otherwise `ConfigError`).

The inputs of both products are quantized dynamically per token (channel and tensor: one scale per token, the
checkpoint's ``strategy: token`` and vLLM's, to int8 for int8 experts as compressed-tensors quantizes them; block: in
groups of the block's columns); under a tensor-parallel split the down product's input is this rank's intermediate
columns. fp8 experts with static activation scales (``input_activations`` ``strategy: tensor``, ``dynamic:
false``; channel or tensor weights): each expert matrix's scalar ``input_scale`` staged and reduced to one scale per
product as fp8_experts.py's (`fp8_experts.attach_input_scales`: the largest over the experts, vLLM's), each input
quantized with it. Refused by name (`expert_scheme`): static int8 activation scales on experts, experts of two
schemes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.compressed_tensors_config import CompressedTensorsCheckpointConfig, CompressedTensorsScheme
from asyncllm.models.fp8_checkpoint import DUMMY_INPUT_SCALE, quantize_fp8_blocks
from asyncllm.models.fp8_experts import (
    attach_input_scales,
    attach_tensor_scales,
    check_blocks,
    compute_in_fp8,
    fp8_weights,
    make_input_scale_params,
    pop_staged_scales,
    whole_row_group,
)
from asyncllm.models.int8 import int8_scale, quantize_int8
from asyncllm.models.layers import LoadedWeight, check_whole_size, copy_weight, new_param, scalar_weight, weight_narrow
from asyncllm.models.moe import FusedMoE
from asyncllm.models.quantization import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_fp8

__all__ = ["expert_scheme", "make_ct_w8a8_expert_params", "finish_ct_w8a8_experts", "quantize_drawn_ct_w8a8_experts"]


def _checkpoint_modules(model: nn.Module, name: str) -> list[str]:
    """The checkpoint modules of every expert matrix of the `FusedMoE` ``name`` (``...experts.3.up_proj``)."""
    unpacked = getattr(model, "_unpacked", None)
    if unpacked is None:
        return [f"{name}.0.down_proj"]
    return [ckpt.removesuffix(".weight") for weight in ("w13_weight", "w2_weight")
            for ckpt, _ in unpacked(f"{name}.{weight}")]


def _layer_schemes(model: nn.Module, cfg: CompressedTensorsCheckpointConfig
                   ) -> list[tuple[str, FusedMoE, CompressedTensorsScheme | None]]:
    """(name, experts, scheme) of every `FusedMoE`: None when the checkpoint left its experts float; `ConfigError`
    when its expert matrices have different schemes (or some are ignored)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            schemes = {cfg.scheme_of(ckpt) for ckpt in _checkpoint_modules(model, name)}
            if len(schemes) > 1:
                raise ConfigError("model", name, "one compressed-tensors scheme for all of a layer's experts (or "
                                                 "all of them ignored)")
            found.append((name, module, schemes.pop()))
    return found


def expert_scheme(model: nn.Module, cfg: CompressedTensorsCheckpointConfig) -> CompressedTensorsScheme | None:
    """The one scheme of the model's quantized experts (None: no experts, or all left float); `NotBuiltError` for
    experts of two schemes, or int8 W8A8 experts with static activation scales."""
    return _one_scheme(_layer_schemes(model, cfg))


def _one_scheme(layers: list[tuple[str, FusedMoE, CompressedTensorsScheme | None]]
                ) -> CompressedTensorsScheme | None:
    schemes = {scheme for _, _, scheme in layers if scheme is not None}
    if not schemes:
        return None
    scheme = next(iter(schemes))
    kinds = ", ".join(sorted(f"{s.kind} {s.strategy}" for s in schemes))
    if len(schemes) > 1:
        raise NotBuiltError("model", kinds, "compressed-tensors experts other than one fp8 or int8 W8A8 scheme with "
                                            "dynamic activations (FP8_DYNAMIC, FP8_BLOCK, W8A8) or one "
                                            "pack-quantized integer scheme (W4A16 / W8A16): experts of two schemes")
    if scheme.static_input and scheme.kind != "fp8":
        raise NotBuiltError("model", kinds, f"static {scheme.kind} activation scales (input_scale) on "
                                            "compressed-tensors experts: their inputs are quantized dynamically "
                                            "(static scales: fp8 experts only)")
    return scheme


def _w8a8_layers(model: nn.Module, cfg: CompressedTensorsCheckpointConfig
                 ) -> list[tuple[str, FusedMoE, CompressedTensorsScheme]]:
    """(name, experts, scheme) of every `FusedMoE` whose experts are fp8 or int8 W8A8 (`expert_scheme`'s refusals
    first)."""
    layers = _layer_schemes(model, cfg)
    scheme = _one_scheme(layers)
    if scheme is None or scheme.kind not in ("fp8", "int8"):
        return []
    return [(name, moe, scheme) for name, moe, layer_scheme in layers if layer_scheme is not None]


def _scale_shape(moe: FusedMoE, part: str, scheme: CompressedTensorsScheme, hidden: int) -> tuple[int, ...]:
    """A staging scale's shape over the local experts: this rank's rows and columns of the matrix's scales."""
    rows, cols = (hidden, moe.intermediate) if part == "down" else (moe.intermediate, hidden)
    if scheme.strategy == "tensor":
        return moe.num_local_experts, 1, 1
    if scheme.strategy == "channel":
        return moe.num_local_experts, rows, 1
    bn, bk = scheme.block  # type: ignore[misc]
    return moe.num_local_experts, -(-rows // bn), -(-cols // bk)


def make_ct_w8a8_expert_params(model: nn.Module, cfg: CompressedTensorsCheckpointConfig) -> int:
    """Before loading: fp8 or int8 ``w13`` / ``w2`` and the staging scales of every W8A8 `FusedMoE`; how many
    layers."""
    layers = _w8a8_layers(model, cfg)
    for name, moe, scheme in layers:
        if scheme.block is not None:
            check_blocks(name, moe, scheme.block)
        hidden = moe.w13_weight.shape[2]
        fp8_weights(moe, torch.int8 if scheme.kind == "int8" else FP8_DTYPE)
        loader = functools.partial(_load_scale, moe, scheme)
        with torch.device(moe.w13_weight.device):
            for part in moe.parts:
                setattr(moe, f"{part}_weight_scale", new_param(*_scale_shape(moe, part, scheme, hidden),
                                                               dtype=torch.float32, loader=loader))
        if scheme.static_input:
            make_input_scale_params(moe)
    return len(layers)


def _load_scale(moe: FusedMoE, scheme: CompressedTensorsScheme, param: nn.Parameter, loaded: LoadedWeight,
                shard_id: tuple[int, str]) -> None:
    """One expert matrix's ``weight_scale``: whole (tensor; the down's rows), or this rank's rows of the gate and
    up (per row or block row), or the down's block columns (the whole tensor's rows or columns checked first: a
    larger one would load cut short)."""
    expert, part = shard_id
    dst = param.data[expert - moe.expert_start]
    start = moe.intermediate_start
    bn, bk = scheme.block or (1, 1)
    if scheme.strategy == "tensor":
        copy_weight(dst, scalar_weight(loaded).reshape(1, 1))
    elif part != "down":
        check_whole_size(loaded, 0, -(-moe.whole_intermediate // bn))
        copy_weight(dst, weight_narrow(loaded, 0, start // bn, dst.shape[0]))
    elif scheme.block is not None:
        check_whole_size(loaded, 1, -(-moe.whole_intermediate // bk))
        copy_weight(dst, weight_narrow(loaded, 1, start // bk, dst.shape[1]))
    else:
        copy_weight(dst, loaded)


@torch.no_grad()
def finish_ct_w8a8_experts(model: nn.Module, cfg: CompressedTensorsCheckpointConfig) -> None:
    """After loading: each W8A8 `FusedMoE`'s staging scales become its block scales (see the module)."""
    for _, moe, scheme in _w8a8_layers(model, cfg):
        scales = pop_staged_scales(moe)
        _attach_scales(moe, scheme, torch.cat(scales[:-1], dim=1), scales[-1])
        if scheme.static_input:
            attach_input_scales(moe, pop_staged_scales(moe, "input_scale"))


def _attach_scales(moe: FusedMoE, scheme: CompressedTensorsScheme, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """``w13 [E, rows, c]`` (the gate's then the up's) and ``w2``, in the staging's layout, as block scales."""
    if scheme.strategy == "tensor":
        attach_tensor_scales(moe, w13.reshape(w13.shape[0], -1), w2.reshape(-1))
        return
    block = scheme.block or (1, whole_row_group(moe))  # channel: each row's scale over all of its K
    for name, scales in (("w13", w13), ("w2", w2)):
        setattr(moe, f"{name}_weight_scale_inv", nn.Parameter(scales.contiguous(), requires_grad=False))
    compute_in_fp8(moe, block)


@torch.no_grad()
def _quantize_drawn(w: torch.Tensor, scheme: CompressedTensorsScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, rows, cols]`` -> (fp8 or int8, scales in the staging's layout): per block, row or matrix, ``max / 448``
    (int8: compressed-tensors' ``max / 127.5``)."""
    if scheme.block is not None:
        parts = [quantize_fp8_blocks(matrix, scheme.block) for matrix in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    dims = (1, 2) if scheme.strategy == "tensor" else (2,)
    if scheme.kind == "int8":
        scales = int8_scale(w.abs().amax(dim=dims, keepdim=True))
        return quantize_int8(w, scales), scales
    scales = (w.abs().amax(dim=dims, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_fp8(w, scales), scales


@torch.no_grad()
def quantize_drawn_ct_w8a8_experts(model: nn.Module, cfg: CompressedTensorsCheckpointConfig) -> None:
    """``load_format="dummy"``: every W8A8 `FusedMoE`'s drawn experts quantized into its scheme, each matrix on
    its own (the gate's and the up's scales apart)."""
    for name, moe, scheme in _w8a8_layers(model, cfg):
        if scheme.block is not None:
            check_blocks(name, moe, scheme.block)
        inter = moe.intermediate
        w13 = [moe.w13_weight.data[:, i * inter:(i + 1) * inter] for i in range(len(moe.parts) - 1)]
        quantized = [_quantize_drawn(w, scheme) for w in (*w13, moe.w2_weight.data)]
        moe.w13_weight = nn.Parameter(torch.cat([q for q, _ in quantized[:-1]], dim=1), requires_grad=False)
        moe.w2_weight = nn.Parameter(quantized[-1][0], requires_grad=False)
        _attach_scales(moe, scheme, torch.cat([s for _, s in quantized[:-1]], dim=1), quantized[-1][1])
        if scheme.static_input:
            moe.w13_input_scale, moe.w2_input_scale = (torch.tensor(DUMMY_INPUT_SCALE, device=moe.w13_weight.device)
                                                       for _ in range(2))
