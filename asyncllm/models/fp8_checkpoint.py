"""Serving pre-quantized fp8 checkpoints (config.json ``quantization_config.quant_method == "fp8"``), as vLLM does.

`loader.load_model` calls, around the checkpoint's loading:

1. `make_fp8_params`: every parallel linear layer (`LinearBase`) that the checkpoint quantized gets a
   float8_e4m3fn ``weight`` and the checkpoint's scales as parameters, each with a ``weight_loader`` that
   copies this rank's part, so the model's ``load_weights`` (fused q/k/v and gate/up included) fills them:
   - **block-wise** (``weight_block_size = [bn, bk]``, DeepSeek-V3 / Qwen3-FP8): ``weight_scale_inv``
     ``[ceil(out/bn), ceil(in/bk)]``, the multiplier of each ``bn x bk`` block. A fused layer's shards, and
     under tensor parallelism each rank's slice, must start on a block boundary: a split through a block is
     a `ConfigError` naming the layer and the sizes (vLLM's ``validate_fp8_block_shape``);
   - **per-tensor** (no block size): ``weight_scale`` with one scalar per checkpoint tensor (q, k and v of a
     ``qkv_proj`` each have theirs); with ``activation_scheme: "static"`` an ``input_scale`` the same way
     (`new_tensor_scale`, shared with compressed_tensors.py).
   Layers named in ``modules_to_not_convert`` / ``ignored_layers`` stay as they are (model dtype).
2. `finish_fp8_params` once the weights are in: block-wise layers compute through `Fp8BlockLinearMethod`;
   per-tensor layers requantize their shards to the largest shard scale (vLLM's
   ``requantize_with_max_scale``) and then compute as online fp8 (`quantization.Fp8LinearMethod`), their
   activations per token or, static, with the largest of their shards' input scales (`take_input_scale`).

With ``load_format="dummy"``, `quantize_drawn_weights` quantizes the drawn model-dtype weights into the same
formats instead. The arithmetic, and what is not built, are in docs/quantization.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ConfigError
from asyncllm.kernels import reference
from asyncllm.models.checkpoint import Fp8CheckpointConfig
from asyncllm.models.layers import LoadedWeight, check_whole_size, copy_weight, new_param, scalar_weight, weight_narrow
from asyncllm.models.linear import (
    LinearBase,
    RowParallelLinear,
)
from asyncllm.models.quantized_layers import output_partitions, quantized_layers, shard_index
from asyncllm.models.quantization import (
    FP8_DTYPE,
    attach_fp8_weight,
    disable_fused_decode,
    fp8_to_float,
    quantize_fp8,
    quantize_fp8_per_tensor,
    scaled_mm_supported,
)

__all__ = ["Fp8BlockLinearMethod", "block_fp8_linear_fallback", "quantize_fp8_blocks", "make_fp8_params",
           "finish_fp8_params", "quantize_drawn_weights", "replace_weight", "load_tensor_scale", "check_block_split",
           "new_block_scale", "attach_block_fp8_weight", "new_tensor_scale", "take_input_scale",
           "DUMMY_INPUT_SCALE"]

DUMMY_INPUT_SCALE = 1.0 / 64
"""``load_format="dummy"``: the static fp8 activation scale drawn (inputs up to 7 before they saturate)."""


# ---------------------------------------------------------------- the product
def block_fp8_linear_fallback(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                              block: tuple[int, int], bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(dq(q(x)), dq(W_q), b)`` in ``dtype``: ``x [M, K]`` quantized per token in groups of ``bk``,
    the weight dequantized per ``bn x bk`` block, each rounded once to ``dtype``."""
    x_q, x_s = reference.per_token_group_quant_fp8(x, block[1])
    x_dq = fp8_to_float(x_q) * reference.expand_block_scales(x_s, tuple(x_q.shape), (1, block[1]))
    w_dq = fp8_to_float(weight) * reference.expand_block_scales(weight_scale_inv, tuple(weight.shape), block)
    return F.linear(x_dq.to(dtype), w_dq.to(dtype), bias)


class Fp8BlockLinearMethod:
    """A block-quantized layer's product (`LinearBase.quant_method`): on CUDA with fp8 support (compute capability
    >= 8.9) the Triton kernels of kernels/block_fp8.py (per-token-group quantization, block-scaled fp8 GEMM), else
    the dequantize fallback."""

    def __init__(self, block: tuple[int, int], use_triton: bool) -> None:
        self.block = block
        self.use_triton = use_triton

    def __repr__(self) -> str:
        return f"Fp8BlockLinearMethod(block={list(self.block)}, {'triton' if self.use_triton else 'dequantize'})"

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if not self.use_triton:
            out = block_fp8_linear_fallback(x2, layer.weight, layer.weight_scale_inv, self.block, bias,
                                            layer.params_dtype)
        else:
            from asyncllm.kernels.block_fp8 import (
                per_token_group_quant_fp8,
                w8a8_block_fp8_matmul,
            )

            x_q, x_s = per_token_group_quant_fp8(x2.contiguous(), self.block[1])
            out = w8a8_block_fp8_matmul(x_q, x_s, layer.weight, layer.weight_scale_inv, self.block,
                                        layer.params_dtype)
            if bias is not None:
                out = out + bias
        return out.view(*lead, out.shape[-1])


@torch.no_grad()
def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` -> (float8_e4m3fn ``[R, C]``, float32 ``[ceil(R/bn), ceil(C/bk)]``): one scale per block,
    ``max|block| / 448``, the checkpoints' ``weight_scale_inv`` (``w ~ q * scale`` per block)."""
    (rows, cols), (bn, bk) = w.shape, block
    rb, cb = -(-rows // bn), -(-cols // bk)
    padded = F.pad(w.float(), (0, cb * bk - cols, 0, rb * bn - rows)).view(rb, bn, cb, bk)
    scale = (padded.abs().amax(dim=(1, 3)) / reference.FP8_E4M3_MAX).clamp(min=reference.FP8_MIN_SCALE)
    q = quantize_fp8(w, reference.expand_block_scales(scale, (rows, cols), block))
    return q, scale


# ---------------------------------------------------------------- block boundaries
def check_block_split(name: str, layer: LinearBase, block: tuple[int, int], label: str = "weight_block_size") -> None:
    """Every shard's, and under TP every rank's, rows (columns for a row-parallel layer) start on a block; ``label``:
    the checkpoint's name for the block."""
    (bn, bk), tp_size = block, layer.tp.size
    if isinstance(layer, RowParallelLinear):
        sizes, split, what = [layer.input_size_per_rank], tp_size > 1, ("input features", bk, "columns")
    else:
        sizes = output_partitions(layer)
        split, what = tp_size > 1 or len(sizes) > 1, ("output rows", bn, "rows")
    bad = [size for size in sizes if size % what[1]]
    if split and bad:
        raise ConfigError("tensor_parallel_size", tp_size,
                          f"a split on whole fp8 weight blocks: {name} holds {sizes} {what[0]} per checkpoint tensor "
                          f"on each rank, and {bad} is not a multiple of the block's {what[1]} {what[2]} "
                          f"({label} {list(block)})")


# ---------------------------------------------------------------- the scales' loaders
def _load_column_blocks(layer: LinearBase, block_rows: int, param: nn.Parameter, loaded: LoadedWeight,
                        shard_id: object = None) -> None:
    """The checkpoint tensor's block rows of this rank's rows, into the shard's block rows (the tensor's whole
    block rows checked first: a larger one would load cut short)."""
    check_whole_size(loaded, 0, -(-layer._checkpoint_rows(shard_id) // block_rows))  # type: ignore[attr-defined]
    dst, src, length = layer._shard_rows(shard_id)  # type: ignore[attr-defined]
    blocks = -(-length // block_rows)
    copy_weight(param.data.narrow(0, dst // block_rows, blocks), weight_narrow(loaded, 0, src // block_rows, blocks))


def _load_row_blocks(layer: RowParallelLinear, block_cols: int, param: nn.Parameter, loaded: LoadedWeight) -> None:
    """The checkpoint tensor's block columns of this rank's input columns (its whole block columns checked first)."""
    check_whole_size(loaded, 1, -(-layer.input_size_per_rank * layer.tp.size // block_cols))
    start = layer.tp.rank * layer.input_size_per_rank // block_cols
    copy_weight(param.data, weight_narrow(loaded, 1, start, param.shape[1]))


def load_tensor_scale(layer: LinearBase, param: nn.Parameter, loaded: LoadedWeight, shard_id: object = None) -> None:
    """A checkpoint tensor's scalar ``weight_scale`` (or ``input_scale``) into its shard's slot."""
    param.data[shard_index(layer, shard_id)] = scalar_weight(loaded)


def new_tensor_scale(layer: LinearBase) -> nn.Parameter:
    """One float32 scalar per checkpoint tensor of the layer (q, k and v each their ``weight_scale``, or their static
    ``input_scale``), on the weight's device, with `load_tensor_scale` as its loader."""
    with torch.device(layer.weight.device):
        return new_param(len(output_partitions(layer)), dtype=torch.float32,
                         loader=functools.partial(load_tensor_scale, layer))


def take_input_scale(layer: LinearBase) -> torch.Tensor:
    """After loading: the layer's one static activation scale, the largest of its shards' (one activation feeds
    them all: vLLM's rule); the per-shard parameter is removed."""
    scale = layer.input_scale.data.max()
    del layer.input_scale
    return scale


# ---------------------------------------------------------------- before and after loading
def replace_weight(layer: LinearBase, dtype: torch.dtype = FP8_DTYPE) -> torch.device:
    """An empty ``dtype`` (fp8; int8) weight of the same shape and loader (the model-dtype one is freed)."""
    old = layer.weight
    with torch.device(old.device):
        layer.weight = new_param(*old.shape, dtype=dtype, loader=old.weight_loader)  # type: ignore[attr-defined]
    return old.device


def new_block_scale(name: str, layer: LinearBase, block: tuple[int, int],
                    label: str = "weight_block_size") -> nn.Parameter:
    """The float32 ``[ceil(out/bn), ceil(in/bk)]`` block scales of a layer (on its weight's device), with the loader of
    this rank's block rows (column-parallel) or block columns (row-parallel), after `check_block_split`."""
    check_block_split(name, layer, block, label)
    out_features, in_features = layer.weight.shape
    if isinstance(layer, RowParallelLinear):
        loader = functools.partial(_load_row_blocks, layer, block[1])
    else:
        loader = functools.partial(_load_column_blocks, layer, block[0])
    with torch.device(layer.weight.device):
        return new_param(-(-out_features // block[0]), -(-in_features // block[1]), dtype=torch.float32,
                         loader=loader)


def attach_block_fp8_weight(layer: LinearBase, w_q: torch.Tensor, scale: torch.Tensor,
                            block: tuple[int, int]) -> Fp8BlockLinearMethod:
    """Make ``w_q`` (float8_e4m3fn ``[N, K]``) and its block scales ``weight_scale_inv`` the layer's, computed by an
    `Fp8BlockLinearMethod` (Triton on CUDA with fp8, else the fallback)."""
    layer.weight = nn.Parameter(w_q, requires_grad=False)
    layer.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
    layer.quant_method = Fp8BlockLinearMethod(block, scaled_mm_supported(w_q.device))
    return layer.quant_method


def _make_layer_params(name: str, layer: LinearBase, cfg: Fp8CheckpointConfig) -> None:
    block = cfg.weight_block_size
    if block is not None:
        layer.weight_scale_inv = new_block_scale(name, layer, block)
    replace_weight(layer)
    if block is None:
        layer.weight_scale = new_tensor_scale(layer)
    if cfg.static_input:
        layer.input_scale = new_tensor_scale(layer)


def make_fp8_params(model: nn.Module, cfg: Fp8CheckpointConfig) -> int:
    """Give every layer the checkpoint quantized its fp8 weight and scale parameters (before loading); returns
    how many. `ConfigError` when a block-wise layer's TP split or fused shards cut through a block."""
    count = 0
    for name, layer in quantized_layers(model, cfg.is_ignored):
        _make_layer_params(name, layer, cfg)
        count += 1
    disable_fused_decode(model)
    return count


@torch.no_grad()
def _requantize_to_max_scale(layer: LinearBase, static_input: bool) -> None:
    """Per-tensor: one scale for the layer, the largest of its shards'; the others' rows are requantized.
    ``static_input``: the activations quantized with the largest of the shards' input scales."""
    scales = layer.weight_scale.data
    del layer.weight_scale
    weight, max_scale = layer.weight.data, scales.max()
    start = 0
    for size, scale in zip(output_partitions(layer), scales.tolist()):
        rows = weight[start:start + size]
        if scale != float(max_scale):
            rows.copy_(quantize_fp8(fp8_to_float(rows) * scale, max_scale))
        start += size
    attach_fp8_weight(layer, weight, max_scale, take_input_scale(layer) if static_input else None)


def finish_fp8_params(model: nn.Module, cfg: Fp8CheckpointConfig) -> None:
    """After loading: each fp8 layer's product (see the module's docstring)."""
    for _, layer in quantized_layers(model, cfg.is_ignored):
        if cfg.weight_block_size is None:
            _requantize_to_max_scale(layer, cfg.static_input)
        else:
            layer.quant_method = Fp8BlockLinearMethod(cfg.weight_block_size, scaled_mm_supported(layer.weight.device))


@torch.no_grad()
def quantize_drawn_weights(model: nn.Module, cfg: Fp8CheckpointConfig) -> None:
    """``load_format="dummy"``: the drawn model-dtype weights quantized into the checkpoint's format (each rank's
    shard whole: block-wise, or one scale per layer, with `DUMMY_INPUT_SCALE` when static)."""
    block = cfg.weight_block_size
    for name, layer in quantized_layers(model, cfg.is_ignored):
        if block is not None:
            check_block_split(name, layer, block)
            attach_block_fp8_weight(layer, *quantize_fp8_blocks(layer.weight.data, block), block)
        else:
            input_scale = torch.tensor(DUMMY_INPUT_SCALE, device=layer.weight.device) if cfg.static_input else None
            attach_fp8_weight(layer, *quantize_fp8_per_tensor(layer.weight.data), input_scale)
    disable_fused_decode(model)
