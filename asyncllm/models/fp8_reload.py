"""New float weights into an online-fp8 model (``quantization="fp8"``), layer by layer: live weight updates.

`quantize_fp8_linears` replaced each decoder linear's weight by its fp8 quantization with one scale per tensor and
rank, and freed the float weight. To load new float weights into such a model (`update_weights`,
`update_weights_from_tensors`; docs/weight-updates.md), `requantizing` puts a stand-in parameter in each quantized
layer for the loader to write into. The first part that arrives for a layer (a q, k or v of a fused ``qkv_proj``,
a gate or up, or a whole unfused matrix) allocates that layer's float weight; once every part has arrived it is
quantized as at load (the same scale rule) and copied into the fp8 weight and scale **in place**, and the float
weight is freed. Checkpoints and state_dicts list a layer's tensors together, so about one layer's float weight
is alive at a time, not the model's.

A layer that got only some of its parts (a subset of a state_dict) has the others filled from its current
weights, dequantized, then is quantized again with the new scale: their values move by at most one fp8 rounding
step. A layer that got none keeps its weights untouched.

Online fp8 experts (asyncllm/models/fp8_online_experts.py) keep a scale per expert matrix: each matrix that arrives
is quantized alone, in place (`ExpertsReload`); the others keep their values and scales.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from asyncllm.models.fp8_online_experts import ExpertsReload
from asyncllm.models.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from asyncllm.models.moe import FusedMoE
from asyncllm.models.quantization import Fp8LinearMethod, dequantize_fp8, quantize_fp8_per_tensor

__all__ = ["requantizing"]


class _Layer:
    """One quantized layer while new weights load: its fp8 parameter, the parts expected and received, the float
    weight they go into (allocated at the first part)."""

    def __init__(self, layer: LinearBase) -> None:
        self.layer = layer
        self.fp8 = layer.weight
        self.expected = _parts(layer)
        self.received: set[object] = set()
        self.float: nn.Parameter | None = None

    def stand_in(self) -> nn.Parameter:
        """The parameter the model's loader finds in the layer's place: meta (no memory), routing to `load`."""
        param = nn.Parameter(torch.empty(self.fp8.shape, dtype=self.layer.params_dtype, device="meta"),
                             requires_grad=False)
        param.weight_loader = self.load  # type: ignore[attr-defined]
        return param

    def load(self, _: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        if self.float is None:
            self.float = nn.Parameter(torch.empty(self.fp8.shape, dtype=self.layer.params_dtype,
                                                  device=self.fp8.device), requires_grad=False)
        if shard_id is None:
            self.layer.weight_loader(self.float, loaded)
        else:
            self.layer.weight_loader(self.float, loaded, shard_id)
        self.received.add(shard_id)
        if self.received >= self.expected:
            self.requantize()

    def fill_missing(self) -> None:
        """The parts no tensor came for, from the current weights (dequantized), then requantize."""
        if self.float is None:
            return
        current = dequantize_fp8(self.fp8.data, self.layer.weight_scale, self.layer.params_dtype)
        for shard_id in self.expected - self.received:
            start, _, length = self.layer._shard_rows(shard_id)  # type: ignore[attr-defined]
            self.float.data[start:start + length] = current[start:start + length]
        self.requantize()

    @torch.no_grad()
    def requantize(self) -> None:
        assert self.float is not None
        w_q, scale = quantize_fp8_per_tensor(self.float.data)
        self.fp8.data.copy_(w_q)
        layer = self.layer
        layer.weight_scale.copy_(scale)
        row = getattr(layer, "weight_scale_row", None)
        if row is not None:
            row.copy_(scale.reshape(1, -1).expand_as(row))
        self.float, self.received = None, set()


def _parts(layer: LinearBase) -> set[object]:
    """The shard ids a layer's weight loads in (None: one unfused matrix)."""
    if isinstance(layer, QKVParallelLinear):
        return {"q", "k", "v"}
    if isinstance(layer, MergedColumnParallelLinear):
        return set(range(len(layer.output_sizes_per_rank)))
    assert isinstance(layer, RowParallelLinear) or hasattr(layer, "_shard_rows"), type(layer)
    return {None}


@contextmanager
def requantizing(model: nn.Module) -> Iterator[None]:
    """Inside: the model's `load_weights` writes new float weights into its online-fp8 layers (requantized in place
    as each layer completes); on leaving, partly written layers are completed and every fp8 parameter is back."""
    layers = [_Layer(module) for module in model.modules()
              if isinstance(module, LinearBase) and isinstance(module.quant_method, Fp8LinearMethod)]
    experts = [ExpertsReload(module) for module in model.modules()
               if isinstance(module, FusedMoE) and module.fp8_block is not None]
    for entry in layers:
        entry.layer.weight = entry.stand_in()
    for reload in experts:
        reload.swap_in()
    try:
        yield
        for entry in layers:
            entry.fill_missing()
    finally:
        for entry in layers:
            entry.layer.weight = entry.fp8
        for reload in experts:
            reload.restore()
