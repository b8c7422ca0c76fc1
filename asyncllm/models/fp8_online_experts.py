"""Online fp8 experts: ``quantization="fp8"`` on a float mixture-of-experts checkpoint quantizes its experts too.

After loading (or drawing, ``load_format="dummy"``), where the dense layers are quantized
(asyncllm/models/quantization.py), `quantize_fp8_experts` turns each `FusedMoE` of the text decoder into the
per-tensor fp8 experts of pre-quantized checkpoints (asyncllm/models/fp8_experts.py, docs/quantization.md):

- **weights**: each local expert's gate, up and down matrix (this rank's rows of gate and up, its columns of down)
  by its own scale ``max|W| / 448``, into float8_e4m3fn ``w13_weight`` / ``w2_weight``; the gate and up keep a
  scale each (vLLM's ``Fp8MoEMethod`` gives an expert's ``w13`` one: a finer scale costs nothing here, and lets an
  update requantize each matrix alone). The scales are the block scales ``w13_weight_scale_inv [E, 2, 1]`` /
  ``w2_weight_scale_inv`` of an ``(I, K)`` block (`fp8_experts.whole_row_group`), kept as buffers (as the dense
  layers' ``weight_scale``: a float checkpoint has no such tensors to load);
- **activations**: as the per-tensor checkpoints' experts, one scale per token (vLLM quantizes the experts' inputs
  per tensor, dynamically).

The float experts are freed as each layer is done (quantized expert by expert: a float32 temporary of one expert).
Experts with their own forward (gpt-oss's biases and clamped SwiGLU) stay in the model dtype, logged.

Live weight updates (asyncllm/models/fp8_reload.py) put `ExpertsReload` stand-ins in the fp8 weights' place: each
expert matrix that arrives is quantized by its own new scale into the fp8 weight and its block scales, in place.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from asyncllm.models.fp8_experts import attach_tensor_scales, quantize_per_matrix
from asyncllm.models.moe import FusedMoE
from asyncllm.models.quantization import (FP8_DTYPE, QuantizationSummary, quantize_fp8_per_tensor, scaled_mm_supported,
                                          tensors_nbytes)

__all__ = ["takes_online_fp8", "online_fp8_expert_layers", "quantize_fp8_experts", "ExpertsReload"]

logger = logging.getLogger("asyncllm.models")

_SCALES = ("w13_weight_scale_inv", "w2_weight_scale_inv")


def takes_online_fp8(experts: FusedMoE) -> bool:
    """Whether ``experts`` compute in fp8 under online quantization: they run `FusedMoE`'s own forward, which hands
    the fp8 scales to the fused-MoE op (gpt-oss's, with biases and a clamped SwiGLU, does not)."""
    return type(experts).forward is FusedMoE.forward


def online_fp8_expert_layers(decoder: nn.Module) -> list[FusedMoE]:
    """The decoder's experts that `takes_online_fp8`, on a device that computes fp8 (the CPU's dequantizing
    reference, or a GPU from Ada on: before it the reference's per-expert loop would be the experts' op, which syncs
    with the host and cannot be captured in a CUDA graph); the others are logged and left in the model dtype."""
    layers, kept, no_fp8 = [], set(), False
    for module in decoder.modules():
        if isinstance(module, FusedMoE):
            if not _computes_fp8(module.w13_weight.device):
                no_fp8 = True
            elif takes_online_fp8(module):
                layers.append(module)
            else:
                kept.add(type(module).__name__)
    if kept:
        logger.info("fp8: %s experts kept in the model dtype (their forward has no fp8 path)", ", ".join(sorted(kept)))
    if no_fp8:
        logger.info("fp8: experts kept in the model dtype (this GPU has no fp8 compute: compute capability < 8.9)")
    return layers


def _computes_fp8(device: torch.device) -> bool:
    return device.type != "cuda" or scaled_mm_supported(device)


@torch.no_grad()
def quantize_fp8_experts(decoder: nn.Module) -> QuantizationSummary:
    """Quantize the decoder's experts (`online_fp8_expert_layers`) to per-tensor fp8, in place."""
    layers = online_fp8_expert_layers(decoder)
    before = after = 0
    for moe in layers:
        before += tensors_nbytes(moe.w13_weight, moe.w2_weight)
        _quantize_layer(moe)
        after += tensors_nbytes(moe.w13_weight, moe.w2_weight, *(getattr(moe, name) for name in _SCALES))
    on_cpu = all(moe.w13_weight.device.type == "cpu" for moe in layers)
    return QuantizationSummary(len(layers), before, after, "dequantize" if on_cpu else "fused_moe")


def _quantize_layer(moe: FusedMoE) -> None:
    """One layer's experts into fp8 with a scale per matrix; the float weights dropped."""
    w13, w13_scales = _per_expert(moe.w13_weight.data, 2 if moe.gated else 1)
    w2, w2_scales = _per_expert(moe.w2_weight.data, 1)
    moe.w13_weight, moe.w2_weight = (nn.Parameter(w, requires_grad=False) for w in (w13, w2))
    attach_tensor_scales(moe, w13_scales, w2_scales)
    for name in _SCALES:
        scales = getattr(moe, name).data
        delattr(moe, name)
        moe.register_buffer(name, scales)


def _per_expert(weight: torch.Tensor, matrices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [E, rows, cols]`` (each expert ``matrices`` stacked ones) -> (fp8, float32 ``[E, matrices]``),
    one expert at a time."""
    out = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty(weight.shape[0], matrices, dtype=torch.float32, device=weight.device)
    for expert in range(weight.shape[0]):
        out[expert:expert + 1], scales[expert:expert + 1] = quantize_per_matrix(weight[expert:expert + 1], matrices)
    return out, scales


class ExpertsReload:
    """One layer of online fp8 experts while new float weights load (`fp8_reload.requantizing`)."""

    def __init__(self, moe: FusedMoE) -> None:
        self.moe = moe
        self.fp8 = {"w13_weight": moe.w13_weight, "w2_weight": moe.w2_weight}

    def swap_in(self) -> None:
        """Stand-ins (meta: no memory) in the fp8 weights' place, routing the model's loader to `load`."""
        for name, fp8 in self.fp8.items():
            param = nn.Parameter(torch.empty(fp8.shape, dtype=self.moe.params_dtype, device="meta"),
                                 requires_grad=False)
            param.weight_loader = self.load  # type: ignore[attr-defined]
            setattr(self.moe, name, param)

    def restore(self) -> None:
        for name, fp8 in self.fp8.items():
            setattr(self.moe, name, fp8)

    @torch.no_grad()
    def load(self, _: nn.Parameter, loaded: Any, shard_id: tuple[int, str]) -> None:
        """One expert matrix (``shard_id = (expert, part)``): read as at load, quantized by its own scale into its
        rows of the fp8 weight and its block rows of the scales."""
        moe, (expert, part) = self.moe, shard_id
        local, which = expert - moe.expert_start, "w2" if part == "down" else "w13"
        fp8 = self.fp8[f"{which}_weight"].data[local]
        matrix = torch.empty(fp8.shape, dtype=moe.params_dtype, device=fp8.device)
        moe.load_part(matrix, loaded, part)
        rows, block_rows = _part_rows(moe, part)
        w_q, scale = quantize_fp8_per_tensor(matrix[rows])
        fp8[rows].copy_(w_q)
        getattr(moe, f"{which}_weight_scale_inv")[local, block_rows] = scale


def _part_rows(moe: FusedMoE, part: str) -> tuple[slice, slice]:
    """A matrix's rows in its expert's ``w13`` / ``w2``, and its block rows (of ``I`` rows each) in the scales."""
    if part == "down":
        return slice(None), slice(None)
    index = 1 if part == "up" and moe.gated else 0
    return slice(index * moe.intermediate, (index + 1) * moe.intermediate), slice(index, index + 1)
