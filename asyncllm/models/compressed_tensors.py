"""Serving pre-quantized compressed-tensors checkpoints (config.json ``quantization_config.quant_method ==
"compressed-tensors"``, llm-compressor's format), as vLLM does, on asyncllm's fp8, int8 and int4 paths.

`fill_compressed_tensors_weights` (called by `loader.load_model`) runs three steps:

1. `make_compressed_tensors_params`: every parallel linear layer (`LinearBase`) the checkpoint quantized (its
   `CompressedTensorsScheme`, the same for every checkpoint module fused in it) gets the checkpoint's tensors as
   parameters, each with a ``weight_loader`` copying this rank's part (fused q/k/v and gate/up shards stacked):
   - fp8 (``float-quantized``) and int8 W8A8 (``int-quantized``): ``weight`` float8_e4m3fn / int8 ``[out, in]``;
     ``weight_scale`` float ``[out, 1]`` (strategy channel), one scalar per checkpoint tensor (tensor) or, fp8
     block-wise, ``[ceil(out/bn), ceil(in/bk)]`` (block: the rank's block rows or columns, a split through a block a
     `ConfigError` as in fp8_checkpoint.py); ``input_scale`` one scalar per checkpoint tensor (static activations);
   - int (``pack-quantized``): ``weight_packed`` int32 ``[out, in/p]`` (``p = 32/bits`` values per int32 along the
     input, value i at bits ``i*bits``, each stored plus ``2**(bits-1)``); ``weight_scale`` ``[out, in/group]``
     (``[out, 1]``: channel); ``weight_zero_point`` int32 ``[out/p, groups]`` (asymmetric only: packed the same
     way along the output); ``weight_shape`` (its input features checked, then dropped).
   A split through a pack or a group is a `ConfigError` naming the layer.
2. the model's ``load_weights`` fills them;
3. `finish_compressed_tensors_params`: an fp8 layer computes through `quantization.Fp8LinearMethod` with one weight
   scale per output row (a per-tensor scale repeated over its shard's rows: nothing is requantized) and per-token
   or static activation scales (a fused layer's largest ``input_scale``, vLLM's rule), or block-wise through
   `fp8_checkpoint.Fp8BlockLinearMethod` (per-token-group activations); an int8 layer through
   `int8.Int8LinearMethod` with the same per-row weight scales and per-token or static activation scales; an int
   layer becomes an `int4_checkpoint.UnpackedWeight` (zero point ``2**(bits-1)`` when symmetric), kept packed for
   the Triton w4a16 GEMM on CUDA and dequantized once elsewhere.

A mixture of experts' experts (one scheme for all, `compressed_tensors_experts.expert_scheme`) are staged before
step 2 and finished after step 3: pack-quantized ones through asyncllm/models/int4_experts.py, fp8 and int8 W8A8
ones through asyncllm/models/compressed_tensors_experts.py (the fused-MoE op's block-fp8 path and its int8 variant).

The arithmetic and what is refused are in docs/quantization.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.compressed_tensors_config import CompressedTensorsCheckpointConfig, CompressedTensorsScheme
from asyncllm.models.compressed_tensors_experts import (
    expert_scheme,
    finish_ct_w8a8_experts,
    make_ct_w8a8_expert_params,
    quantize_drawn_ct_w8a8_experts,
)
from asyncllm.models.fp8_checkpoint import (
    DUMMY_INPUT_SCALE,
    attach_block_fp8_weight,
    check_block_split,
    new_block_scale,
    new_tensor_scale,
    quantize_fp8_blocks,
    replace_weight,
    take_input_scale,
)
from asyncllm.models.int4_checkpoint import UnpackedWeight, attach_dequantized, attach_packed, unpack_columns
from asyncllm.models.int4_experts import ct_format, finish_int4_experts, make_int4_expert_params
from asyncllm.models.int8 import attach_int8_weight, quantize_int8_weight
from asyncllm.models.layers import (LoadedWeight, check_whole_size, copy_weight, default_weight_loader, new_param,
                                    weight_narrow)
from asyncllm.models.linear import LinearBase, RowParallelLinear
from asyncllm.models.quantization import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    attach_fp8_weight,
    disable_fused_decode,
    quantize_fp8,
)
from asyncllm.models.quantized_layers import checkpoint_modules, output_partitions, quantized_layers

__all__ = ["quantized_schemes", "make_compressed_tensors_params", "finish_compressed_tensors_params",
           "fill_compressed_tensors_weights"]

_INT_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
_DUMMY_INPUT_SCALES = {"fp8": DUMMY_INPUT_SCALE, "int8": 1.0 / 16}
"""``load_format="dummy"``: the static activation scales drawn (inputs up to 7 before they saturate)."""
_BLOCK_LABEL = "block_structure"


def quantized_schemes(model: nn.Module, cfg: CompressedTensorsCheckpointConfig
                      ) -> Iterator[tuple[str, LinearBase, CompressedTensorsScheme]]:
    """(name, layer, scheme) of every parallel linear the checkpoint quantized; `ConfigError` for a fused layer
    whose parts have different schemes (or are ignored in part)."""
    for name, layer in quantized_layers(model, cfg.is_ignored):
        schemes = {cfg.scheme_of(part) for part in checkpoint_modules(model, name)}
        if len(schemes) > 1:
            raise ConfigError("model", name, "one compressed-tensors scheme for all the projections fused in "
                                             f"{name} ({checkpoint_modules(model, name)})")
        yield name, layer, schemes.pop()  # type: ignore[misc]


# ---------------------------------------------------------------- the loaders
def _load_output_rows(layer: LinearBase, unit: int, param: nn.Parameter, loaded: LoadedWeight,
                      shard_id: object = None) -> None:
    """A column-parallel layer: the checkpoint tensor's rows of this rank's output features (``unit`` of them per
    row when packed along the output), into the shard's rows; the tensor's whole rows checked first (a larger one
    would load cut short)."""
    check_whole_size(loaded, 0, -(-layer._checkpoint_rows(shard_id) // unit))  # type: ignore[attr-defined]
    dst, src, length = layer._shard_rows(shard_id)  # type: ignore[attr-defined]
    copy_weight(param.data.narrow(0, dst // unit, length // unit), weight_narrow(loaded, 0, src // unit,
                                                                                 length // unit))


def _load_input_columns(layer: RowParallelLinear, param: nn.Parameter, loaded: LoadedWeight) -> None:
    """A row-parallel layer: this rank's columns (of input features, of their packs or of their groups), every
    rank's together the whole checkpoint tensor's."""
    width = param.shape[1]
    check_whole_size(loaded, 1, width * layer.tp.size)
    copy_weight(param.data, weight_narrow(loaded, 1, layer.tp.rank * width, width))


def _check_weight_shape(in_features: int, param: nn.Parameter, loaded: LoadedWeight, shard_id: object = None) -> None:
    """``weight_shape`` (``[out, in]`` before packing): nothing is kept; the input features must be the model's."""
    shape = [int(v) for v in (loaded if isinstance(loaded, torch.Tensor) else loaded[:]).tolist()]
    if len(shape) != 2 or shape[1] != in_features:
        raise ValueError(f"is {shape}, a weight_shape of {in_features} input features")


# ---------------------------------------------------------------- before loading
def _make_w8a8_params(name: str, layer: LinearBase, scheme: CompressedTensorsScheme) -> None:
    """fp8 or int8 weights stored as they are, their scales (per tensor, row or block), static input scales."""
    row, out_features = isinstance(layer, RowParallelLinear), layer.weight.shape[0]
    block_scale = new_block_scale(name, layer, scheme.block, _BLOCK_LABEL) if scheme.block else None
    with torch.device(replace_weight(layer, torch.int8 if scheme.kind == "int8" else FP8_DTYPE)):
        if block_scale is not None:
            layer.weight_scale = block_scale
        elif scheme.strategy == "tensor":
            layer.weight_scale = new_tensor_scale(layer)
        else:
            loader = default_weight_loader if row else functools.partial(_load_output_rows, layer, 1)
            layer.weight_scale = new_param(out_features, 1, dtype=torch.float32, loader=loader)
    if scheme.static_input:
        layer.input_scale = new_tensor_scale(layer)


def _check_int_split(name: str, layer: LinearBase, scheme: CompressedTensorsScheme, in_features: int) -> None:
    """Each rank's input features on whole packs and groups; with zero points, its output features on packs."""
    pack, group = scheme.pack_factor, scheme.group_size
    what = ""
    if in_features % pack or (group > 0 and in_features % group):
        what = (f"holds {in_features} input features per rank, not a multiple of the {pack} {scheme.bits}-bit "
                f"values packed in an int32" + (f" and of the group_size {group}" if group > 0 else ""))
    bad = [size for size in output_partitions(layer) if size % pack]
    if not scheme.symmetric and bad:
        what = (f"holds {output_partitions(layer)} output features per checkpoint tensor on each rank, and {bad} "
                f"is not a multiple of the {pack} zero points packed in an int32")
    if what:
        tp_size = layer.tp.size  # type: ignore[attr-defined]
        raise ConfigError("tensor_parallel_size" if tp_size > 1 else "model", tp_size if tp_size > 1 else name,
                          f"a split on whole packs and groups of the quantized weights: {name} {what}")


def _make_int_params(name: str, layer: LinearBase, scheme: CompressedTensorsScheme) -> None:
    out_features, in_features = layer.weight.shape
    _check_int_split(name, layer, scheme, in_features)
    row, pack, device = isinstance(layer, RowParallelLinear), scheme.pack_factor, layer.weight.device
    groups = in_features // scheme.group_size if scheme.group_size > 0 else 1
    in_total = in_features * layer.tp.size if row else in_features  # type: ignore[attr-defined]
    del layer.weight
    layer.in_features, layer.out_features = in_features, out_features  # type: ignore[assignment]
    columns = functools.partial(_load_input_columns, layer)
    scales = (columns if scheme.group_size > 0 else default_weight_loader) if row else \
        functools.partial(_load_output_rows, layer, 1)
    with torch.device(device):
        layer.weight_packed = new_param(out_features, in_features // pack, dtype=torch.int32,
                                        loader=columns if row else functools.partial(_load_output_rows, layer, 1))
        layer.weight_scale = new_param(out_features, groups, dtype=torch.float32, loader=scales)
        if not scheme.symmetric:
            zeros = scales if row else functools.partial(_load_output_rows, layer, pack)
            layer.weight_zero_point = new_param(out_features // pack, groups, dtype=torch.int32, loader=zeros)
        layer.weight_shape = new_param(2, dtype=torch.int64, loader=functools.partial(_check_weight_shape, in_total))


def make_compressed_tensors_params(model: nn.Module, cfg: CompressedTensorsCheckpointConfig) -> int:
    """Give every layer the checkpoint quantized its checkpoint tensors as parameters (before loading); returns
    how many layers."""
    count = 0
    for name, layer, scheme in quantized_schemes(model, cfg):
        if scheme.kind == "int":
            _make_int_params(name, layer, scheme)
        else:
            _make_w8a8_params(name, layer, scheme)
        count += 1
    return count


# ---------------------------------------------------------------- after loading
@torch.no_grad()
def _finish_w8a8(layer: LinearBase, scheme: CompressedTensorsScheme) -> None:
    """fp8 block-wise: the block scales as they are. Otherwise one weight scale per output row (a per-tensor one
    repeated over its shard), the fused shards' largest static input scale."""
    scale = layer.weight_scale.data
    del layer.weight_scale
    if scheme.block is not None:
        attach_block_fp8_weight(layer, layer.weight.data, scale, scheme.block)
        return
    if scheme.strategy == "tensor":
        sizes = torch.tensor(output_partitions(layer), device=scale.device)
        scale = torch.repeat_interleave(scale, sizes).unsqueeze(1)
    input_scale = take_input_scale(layer) if scheme.static_input else None
    attach = attach_int8_weight if scheme.kind == "int8" else attach_fp8_weight
    attach(layer, layer.weight.data, scale.contiguous(), input_scale)


@torch.no_grad()
def _unpacked(layer: LinearBase, scheme: CompressedTensorsScheme) -> UnpackedWeight:
    """The loaded checkpoint tensors as ``q [K, N]``, ``zeros [G, N]`` and ``scales [G, N]``, unsigned (the stored
    values: the signed ones plus ``2**(bits-1)``, which the difference cancels)."""
    bits = scheme.bits
    q = unpack_columns(layer.weight_packed.data, bits).t().contiguous()
    scales = layer.weight_scale.data.float().t().contiguous()
    if scheme.symmetric:
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int32, device=q.device)
    else:
        zeros = unpack_columns(layer.weight_zero_point.data.t().contiguous(), bits)
    group = scheme.group_size if scheme.group_size > 0 else q.shape[0]
    return UnpackedWeight(q, zeros, scales, torch.arange(q.shape[0], device=q.device) // group)


def _attach_int(name: str, layer: LinearBase, scheme: CompressedTensorsScheme, w: UnpackedWeight,
                keep_packed: bool, use_triton: bool) -> None:
    for attr in _INT_TENSORS:
        if hasattr(layer, attr):
            delattr(layer, attr)
    if keep_packed:
        group = scheme.group_size if scheme.group_size > 0 else w.q.shape[0]
        attach_packed(name, layer, w, scheme.bits, group, use_triton)
    else:
        attach_dequantized(layer, w)


def finish_compressed_tensors_params(model: nn.Module, cfg: CompressedTensorsCheckpointConfig, use_triton: bool,
                                     keep_packed: bool | None = None) -> None:
    """After loading: each layer's product (see the module's docstring). ``keep_packed`` (default: ``use_triton``)
    with ``use_triton`` False: int layers packed through the torch reference (the GPU's layout on the CPU, for
    tests)."""
    keep_packed = use_triton if keep_packed is None else keep_packed
    for name, layer, scheme in list(quantized_schemes(model, cfg)):
        if scheme.kind == "int":
            _attach_int(name, layer, scheme, _unpacked(layer, scheme), keep_packed, use_triton)
        else:
            _finish_w8a8(layer, scheme)
    _after_finish(model, use_triton)


def _after_finish(model: nn.Module, use_triton: bool) -> None:
    if any(getattr(m, "quant_method", None) is not None for m in model.modules()):
        disable_fused_decode(model)  # kernels/decode_linear.py reads model-dtype weights
    if use_triton:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- load_format="dummy"
@torch.no_grad()
def _drawn_int(layer: LinearBase, scheme: CompressedTensorsScheme) -> UnpackedWeight:
    """The drawn model-dtype weight quantized symmetrically into the scheme's groups."""
    w = layer.weight.data.float().t()
    (k, n), half = w.shape, 1 << (scheme.bits - 1)
    group = scheme.group_size if scheme.group_size > 0 else k
    scales = (w.reshape(k // group, group, n).abs().amax(1) / (half - 1)).clamp(min=1e-8)
    groups = torch.arange(k, device=w.device) // group
    q = (w / scales[groups]).round().clamp(-half, half - 1).int() + half
    return UnpackedWeight(q.contiguous(), torch.full_like(scales, half, dtype=torch.int32), scales, groups)


@torch.no_grad()
def _quantize_drawn_w8a8(name: str, layer: LinearBase, scheme: CompressedTensorsScheme) -> None:
    """A drawn model-dtype weight quantized into an fp8 (one scale per row, or per block) or int8 (per row) scheme."""
    w = layer.weight.data
    if scheme.block is not None:
        check_block_split(name, layer, scheme.block, _BLOCK_LABEL)
        attach_block_fp8_weight(layer, *quantize_fp8_blocks(w, scheme.block), scheme.block)
        return
    input_scale = torch.tensor(_DUMMY_INPUT_SCALES[scheme.kind], device=w.device) if scheme.static_input else None
    if scheme.kind == "int8":
        attach_int8_weight(layer, *quantize_int8_weight(w), input_scale)
        return
    scale = (w.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    attach_fp8_weight(layer, quantize_fp8(w, scale), scale, input_scale)


@torch.no_grad()
def _quantize_drawn(model: nn.Module, cfg: CompressedTensorsCheckpointConfig, use_triton: bool) -> None:
    """``load_format="dummy"``: the drawn weights quantized into each layer's scheme."""
    for name, layer, scheme in list(quantized_schemes(model, cfg)):
        if scheme.kind != "int":
            _quantize_drawn_w8a8(name, layer, scheme)
            continue
        _check_int_split(name, layer, scheme, layer.weight.shape[1])
        w = _drawn_int(layer, scheme)
        del layer.weight
        _attach_int(name, layer, scheme, w, use_triton, use_triton)
    quantize_drawn_ct_w8a8_experts(model, cfg)
    _after_finish(model, use_triton)


def fill_compressed_tensors_weights(model: nn.Module, config: Any, cfg: CompressedTensorsCheckpointConfig,
                                    device: torch.device) -> None:
    """`make_compressed_tensors_params`, the checkpoint, `finish_compressed_tensors_params` (or, with
    ``load_format="dummy"``, random weights quantized into the same schemes)."""
    from asyncllm.models.loader import init_dummy_weights, load_checkpoint, materialize_params, resolve_model_path

    use_triton = device.type == "cuda"
    if use_triton and config.enable_lora and any(scheme.kind == "int" for _, scheme in cfg.groups):
        raise NotBuiltError("enable_lora", True, "LoRA adapters over compressed-tensors weight-only integer layers "
                                                 "(W4A16 / W8A16) on a GPU (their weights stay packed; on the CPU "
                                                 "they are dequantized; W8A8 int8 and fp8 layers take adapters)")
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
        _quantize_drawn(model, cfg, use_triton)
        return
    make_compressed_tensors_params(model, cfg)
    experts = _expert_format(model, cfg)
    if experts is not None:
        make_int4_expert_params(model, experts)
    make_ct_w8a8_expert_params(model, cfg)
    materialize_params(model, device)  # the float parameters left (built on the meta device)
    load_checkpoint(model, resolve_model_path(config.model, config.revision), config.kv_cache_dtype,
                    load_format=config.load_format)
    finish_compressed_tensors_params(model, cfg, use_triton)
    if experts is not None:
        finish_int4_experts(model, experts, keep_packed=use_triton)
    finish_ct_w8a8_experts(model, cfg)


def _expert_format(model: nn.Module, cfg: CompressedTensorsCheckpointConfig) -> Any:
    """The staging format of the model's pack-quantized integer experts (`int4_experts.ct_format`): None without
    experts, with every expert left float, or with fp8 / int8 W8A8 experts (compressed_tensors_experts.py);
    `expert_scheme`'s `NotBuiltError` for the experts refused."""
    scheme = expert_scheme(model, cfg)
    if scheme is None or scheme.kind != "int":
        return None
    return ct_format(scheme, lambda name: cfg.scheme_of(name) is None)
