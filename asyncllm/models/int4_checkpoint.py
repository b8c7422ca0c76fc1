"""Serving pre-quantized AWQ and GPTQ checkpoints (integer weights, model-dtype activations), as vLLM does.

`fill_int4_weights` (called by `loader.load_model`) runs three steps:

1. `make_int4_params`: every parallel linear layer (`LinearBase`) the checkpoint quantized loses its model-dtype
   ``weight`` and gets the checkpoint's tensors as parameters, in the checkpoint's layout, each with a
   ``weight_loader`` copying this rank's part (fused q/k/v and gate/up shards side by side along the output):
   - AWQ: ``qweight`` int32 ``[in, out/8]`` (8 values per int32 along the output, in AWQ's interleaved order
     0 2 4 6 1 3 5 7), ``qzeros`` int32 ``[groups, out/8]`` (the same packing), ``scales`` ``[groups, out]``;
   - GPTQ: ``qweight`` int32 ``[in/p, out]`` (``p = 32/bits`` values per int32 along the input, in order),
     ``qzeros`` int32 ``[groups, out/p]`` (v1 format: each zero point stored minus 1), ``scales`` ``[groups,
     out]``, ``g_idx`` int32 ``[in]`` (the group of each input feature; any order with act-order).
   A split through a pack or a group (fused shards, tensor-parallel slices) is a `ConfigError` naming the layer.
2. the model's ``load_weights`` fills them (extra all-zero biases that some GPTQ checkpoints carry are dropped,
   as vLLM drops them: `drop_extra_biases`);
3. `finish_int4_params`: on CUDA each layer keeps its weights packed, repacked into one layout
   (`kernels/w4a16.py`'s: values along the input, zero points decoded into ``zeros``), and computes through
   `Int4LinearMethod` (the Triton w4a16 GEMM). Elsewhere (the CPU) each layer's weight is dequantized once, in
   float32, rounded to the model dtype, and the layer computes as an unquantized one (no memory is saved there).

The formats, the arithmetic and the memory are in docs/quantization.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.quantized_layers import output_partitions, quantized_layers, shard_index
from asyncllm.models.int4_config import Int4CheckpointConfig
from asyncllm.models.layers import (LoadedWeight, check_whole_size, copy_weight, default_weight_loader, new_param,
                                    weight_narrow)
from asyncllm.models.linear import LinearBase, RowParallelLinear
from asyncllm.models.quantization import disable_fused_decode

__all__ = ["AWQ_ORDER", "Int4LinearMethod", "UnpackedWeight", "unpack_columns", "pack_rows", "unpacked_weight",
           "attach_packed", "attach_dequantized", "make_int4_params", "finish_int4_params", "drop_extra_biases",
           "fill_int4_weights"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ packing: the int32's value i (bits 4i..4i+3) holds output column ``8c + AWQ_ORDER[i]`` of pack c."""
_AWQ_UNPACK = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j of a pack is value _AWQ_UNPACK[j]


# ---------------------------------------------------------------- the layouts
def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` -> int32 ``[R, C * 32/bits]``: value i of ``packed[r, c]`` at column ``c * 32/bits + i``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int ``[K, N]`` (``K`` a multiple of 32/bits) -> int32 ``[K * bits/32, N]``, `reference.unpack_int_rows`'s
    inverse."""
    pack = 32 // bits
    grouped = values.to(torch.int32).view(-1, pack, values.shape[1])
    out = torch.zeros(grouped.shape[0], values.shape[1], dtype=torch.int32, device=values.device)
    for i in range(pack):
        out |= grouped[:, i] << (bits * i)
    return out


@dataclass
class UnpackedWeight:
    """One layer's quantized weight on this rank, unpacked: ``W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``
    with ``g = groups[k]``."""

    q: torch.Tensor
    """int32 ``[K, N]``."""
    zeros: torch.Tensor
    """int32 ``[G, N]``: the zero points (any checkpoint offset applied)."""
    scales: torch.Tensor
    """float32 ``[G, N]``."""
    groups: torch.Tensor
    """int64 ``[K]``: the row of ``scales`` and ``zeros`` of each input feature."""

    def dequantize(self) -> torch.Tensor:
        """``W [K, N]`` in float32."""
        return (self.q.float() - self.zeros[self.groups].float()) * self.scales[self.groups]


# ---------------------------------------------------------------- groups and shards
def _group(layer: LinearBase, cfg: Int4CheckpointConfig) -> int:
    """Input features per group (-1: the whole input, of every rank)."""
    if cfg.group_size > 0:
        return cfg.group_size
    in_features = layer.weight.shape[1] if hasattr(layer, "weight") else layer.in_features  # type: ignore[attr-defined]
    return in_features * (layer.tp.size if isinstance(layer, RowParallelLinear) else 1)  # type: ignore[attr-defined]


def _scales_split(layer: LinearBase, cfg: Int4CheckpointConfig) -> bool:
    """Whether a row-parallel layer's scales and zero points are split by input rows (else every rank holds them
    whole: one group for all the input, or GPTQ act-order, whose groups are spread over the input)."""
    return isinstance(layer, RowParallelLinear) and cfg.group_size > 0 and not cfg.desc_act and layer.tp.size > 1


def _split_error(name: str, layer: LinearBase, what: str) -> ConfigError:
    return ConfigError("tensor_parallel_size", layer.tp.size,  # type: ignore[attr-defined]
                       f"a split on whole packs and groups of the quantized weights: {name} {what}")


def _check_split(name: str, layer: LinearBase, cfg: Int4CheckpointConfig) -> None:
    pack = cfg.pack_factor
    if isinstance(layer, RowParallelLinear):
        k = layer.input_size_per_rank
        if layer.tp.size > 1 and cfg.method == "gptq" and k % pack:
            raise _split_error(name, layer, f"holds {k} input features per rank, not a multiple of the {pack} "
                                            f"{cfg.bits}-bit values packed in an int32")
        if _scales_split(layer, cfg) and k % cfg.group_size:
            raise _split_error(name, layer, f"holds {k} input features per rank, not a multiple of the "
                                            f"group_size {cfg.group_size}")
        return
    sizes = output_partitions(layer)
    bad = [size for size in sizes if size % pack]
    if bad:
        raise _split_error(name, layer, f"holds {sizes} output features per checkpoint tensor on each rank, and "
                                        f"{bad} is not a multiple of the {pack} {cfg.bits}-bit values packed in an int32")


# ---------------------------------------------------------------- the loaders
def _load_columns(layer: LinearBase, dim: int, pack: int, param: nn.Parameter, loaded: LoadedWeight,
                  shard_id: object = None) -> None:
    """A column-parallel layer: the checkpoint tensor's columns of this rank's output features (``pack`` of them
    per column when packed along the output), into the shard's columns; one whose whole size is not the checkpoint
    tensor's (a larger one would load cut short) is a ValueError."""
    check_whole_size(loaded, dim, layer._checkpoint_rows(shard_id) // pack)  # type: ignore[attr-defined]
    dst, src, length = layer._shard_rows(shard_id)  # type: ignore[attr-defined]
    copy_weight(param.data.narrow(dim, dst // pack, length // pack), weight_narrow(loaded, dim, src // pack,
                                                                                  length // pack))


def _load_rows(layer: RowParallelLinear, param: nn.Parameter, loaded: LoadedWeight) -> None:
    """A row-parallel layer: this rank's rows (of input features, of packs of them, or of groups), every rank's
    together the whole checkpoint tensor's."""
    rows = param.shape[-1] if param.dim() == 1 else param.shape[0]
    check_whole_size(loaded, 0, rows * layer.tp.size)
    copy_weight(param.data, weight_narrow(loaded, 0, layer.tp.rank * rows, rows))


def _load_g_idx(layer: LinearBase, param: nn.Parameter, loaded: LoadedWeight, shard_id: object = None) -> None:
    """``g_idx`` of one checkpoint tensor into its shard's row (they must agree: `_groups` checks)."""
    row = param.data[shard_index(layer, shard_id)]
    if isinstance(layer, RowParallelLinear):
        check_whole_size(loaded, 0, row.shape[0] * layer.tp.size)
        loaded = weight_narrow(loaded, 0, layer.tp.rank * row.shape[0], row.shape[0])
    copy_weight(row, loaded)


def _param(layer: LinearBase, name: str, shape: tuple[int, int], dtype: torch.dtype, loader: Any) -> None:
    setattr(layer, name, new_param(*shape, dtype=dtype, loader=loader))


def _make_layer_params(name: str, layer: LinearBase, cfg: Int4CheckpointConfig) -> None:
    _check_split(name, layer, cfg)
    out_features, in_features = layer.weight.shape
    group, pack, row = _group(layer, cfg), cfg.pack_factor, isinstance(layer, RowParallelLinear)
    device, shards = layer.weight.device, 1 if row else len(output_partitions(layer))
    del layer.weight
    layer.in_features, layer.out_features = in_features, out_features  # type: ignore[assignment]
    groups = -(-in_features // group) if not row or _scales_split(layer, cfg) else -(-in_features * layer.tp.size
                                                                                     // group)
    rows = functools.partial(_load_rows, layer)
    whole = default_weight_loader if row and not _scales_split(layer, cfg) else rows
    packed_out = functools.partial(_load_columns, layer, 1, pack)
    plain_out = functools.partial(_load_columns, layer, 1, 1)
    with torch.device(device):
        if cfg.method == "awq":
            _param(layer, "qweight", (in_features, out_features // pack), torch.int32, rows if row else packed_out)
        else:
            _param(layer, "qweight", (in_features // pack, out_features), torch.int32, rows if row else plain_out)
            _param(layer, "g_idx", (shards, in_features), torch.int32, functools.partial(_load_g_idx, layer))
        _param(layer, "qzeros", (groups, out_features // pack), torch.int32, whole if row else packed_out)
        _param(layer, "scales", (groups, out_features), torch.float32, whole if row else plain_out)


def make_int4_params(model: nn.Module, cfg: Int4CheckpointConfig) -> int:
    """Give every layer the checkpoint quantized its checkpoint tensors as parameters (before loading); returns
    how many layers. `ConfigError` when a fused shard or a tensor-parallel slice cuts a pack or a group."""
    count = 0
    for name, layer in quantized_layers(model, cfg.is_ignored):
        _make_layer_params(name, layer, cfg)
        count += 1
    return count


def drop_extra_biases(model: nn.Module, weights: Iterator[tuple[str, LoadedWeight]]
                      ) -> Iterator[tuple[str, LoadedWeight]]:
    """The checkpoint's tensors without the biases of bias-free layers (GPTQ's packers wrote zero ones)."""
    params = {name for name, _ in model.named_parameters()}
    packed = getattr(model, "_packed", lambda name: (name, None))
    for name, weight in weights:
        if name.endswith("_proj.bias") and packed(name)[0] not in params:
            continue
        yield name, weight


# ---------------------------------------------------------------- after loading
def _row_offset(layer: LinearBase) -> int:
    """The first input feature of this rank (row-parallel layers; 0 otherwise)."""
    return layer.tp.rank * layer.in_features if isinstance(layer, RowParallelLinear) else 0  # type: ignore


def _groups(name: str, layer: LinearBase, cfg: Int4CheckpointConfig) -> torch.Tensor:
    """The row of this rank's scales of each of its input features (checked against the loaded ``g_idx``)."""
    in_features, group = layer.in_features, _group(layer, cfg)  # type: ignore[attr-defined]
    local = torch.arange(in_features, device=layer.scales.device) // group
    if cfg.method == "awq":
        return local
    g_idx = layer.g_idx.data.long()
    if any(not torch.equal(g_idx[0], other) for other in g_idx[1:]):
        raise ConfigError("model", name, f"the same g_idx in every checkpoint tensor fused in {name}")
    expected = (torch.arange(in_features, device=local.device) + _row_offset(layer)) // group
    if not cfg.desc_act:
        if not torch.equal(g_idx[0], expected):
            raise ConfigError("model", name, f"a g_idx of k // group_size ({group}) in {name}, as its "
                                             "quantization_config's desc_act false says (true: act-order)")
        return local if _scales_split(layer, cfg) else expected
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= layer.scales.shape[0]:
        raise ConfigError("model", name, f"a g_idx in [0, {layer.scales.shape[0]}) in {name} (its groups), not "
                                         f"[{int(g_idx.min())}, {int(g_idx.max())}]")
    return g_idx[0]


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 ``[R, C]`` -> int32 ``[R, 8C]`` in column order."""
    values = unpack_columns(packed, 4)
    return values.view(packed.shape[0], -1, 8)[:, :, list(_AWQ_UNPACK)].reshape(packed.shape[0], -1)


@torch.no_grad()
def unpacked_weight(name: str, layer: LinearBase, cfg: Int4CheckpointConfig) -> UnpackedWeight:
    """A loaded layer's checkpoint tensors (`make_int4_params`'s parameters) unpacked."""
    if cfg.method == "awq":
        q, zeros = _awq_unpack(layer.qweight.data), _awq_unpack(layer.qzeros.data)
    else:
        q = reference.unpack_int_rows(layer.qweight.data, cfg.bits)
        zeros = (unpack_columns(layer.qzeros.data, cfg.bits) + cfg.zero_offset) & ((1 << cfg.bits) - 1)
    return UnpackedWeight(q, zeros, layer.scales.data.float(), _groups(name, layer, cfg))


class Int4LinearMethod:
    """A packed layer's product (`LinearBase.quant_method`): `kernels/w4a16.py`'s GEMM (``use_triton``), or
    `reference.w4a16_matmul` (the weight dequantized at every call: tests)."""

    def __init__(self, bits: int, group_size: int, use_triton: bool) -> None:
        self.bits = bits
        self.group_size = group_size
        self.use_triton = use_triton

    def __repr__(self) -> str:
        kind = "triton" if self.use_triton else "reference"
        return f"Int4LinearMethod(bits={self.bits}, group_size={self.group_size}, {kind})"

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        if self.use_triton:
            from asyncllm.kernels.w4a16 import w4a16_matmul as matmul
        else:
            matmul = reference.w4a16_matmul
        out = matmul(x2, layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.bits, self.group_size)
        if bias is not None:
            out = out + bias
        return out.view(*lead, out.shape[-1])


_CHECKPOINT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def _drop_checkpoint_tensors(layer: LinearBase) -> None:
    for attr in _CHECKPOINT_TENSORS:
        if hasattr(layer, attr):
            delattr(layer, attr)


@torch.no_grad()
def attach_packed(name: str, layer: LinearBase, w: UnpackedWeight, bits: int, group: int, use_triton: bool) -> None:
    """The kernel's layout for ``w``: ``qweight [K/p, N]`` along the input, ``scales`` and decoded ``zeros``
    (float16 when the scales are float16 values, else float32), ``g_idx`` int32 or None when it is ``k // group``;
    the product through `Int4LinearMethod`."""
    pack = 32 // bits
    if w.q.shape[0] % pack:
        raise ConfigError("model", name, f"a layer whose {w.q.shape[0]} input features are a multiple of {pack}, "
                                         "to pack them along the input for the GPU kernel")
    scale_dtype = torch.float16 if torch.equal(w.scales.half().float(), w.scales) else torch.float32
    trivial = torch.equal(w.groups, torch.arange(w.q.shape[0], device=w.q.device) // group)
    layer.register_buffer("qweight", pack_rows(w.q, bits))
    layer.register_buffer("scales", w.scales.to(scale_dtype))
    layer.register_buffer("zeros", w.zeros.to(scale_dtype))
    layer.register_buffer("g_idx", None if trivial else w.groups.to(torch.int32))
    layer.quant_method = Int4LinearMethod(bits, group, use_triton)


@torch.no_grad()
def attach_dequantized(layer: LinearBase, w: UnpackedWeight) -> None:
    """The CPU path: ``w`` dequantized in float32, rounded once to the model dtype, as the layer's ``[N, K]``
    weight."""
    layer.weight = nn.Parameter(w.dequantize().t().to(layer.params_dtype).contiguous(), requires_grad=False)


def _pack_layer(name: str, layer: LinearBase, cfg: Int4CheckpointConfig, use_triton: bool) -> None:
    w, group = unpacked_weight(name, layer, cfg), _group(layer, cfg)
    _drop_checkpoint_tensors(layer)
    attach_packed(name, layer, w, cfg.bits, group, use_triton)


def _dequantize_layer(name: str, layer: LinearBase, cfg: Int4CheckpointConfig) -> None:
    w = unpacked_weight(name, layer, cfg)
    _drop_checkpoint_tensors(layer)
    attach_dequantized(layer, w)


def finish_int4_params(model: nn.Module, cfg: Int4CheckpointConfig, use_triton: bool,
                       keep_packed: bool | None = None) -> None:
    """After loading: packed layers computing through the Triton GEMM (``use_triton``), else dequantized ones.
    ``keep_packed`` (default: ``use_triton``) with ``use_triton`` False: packed layers through the torch reference
    (the GPU's layout and arithmetic on the CPU, for tests)."""
    keep_packed = use_triton if keep_packed is None else keep_packed
    for name, layer in quantized_layers(model, cfg.is_ignored):
        if keep_packed:
            _pack_layer(name, layer, cfg, use_triton)
        else:
            _dequantize_layer(name, layer, cfg)
    if keep_packed:
        disable_fused_decode(model)
    if use_triton:
        torch.cuda.empty_cache()


@torch.no_grad()
def _draw_int4_weights(model: nn.Module, cfg: Int4CheckpointConfig, seed: int) -> None:
    """``load_format="dummy"``: random packed values and zero points, scales up to 0.005 (weights of about the
    dummy float weights' size), trivial ``g_idx``."""
    gen = torch.Generator().manual_seed(seed)
    for _, layer in quantized_layers(model, cfg.is_ignored):
        for attr in ("qweight", "qzeros"):
            param = getattr(layer, attr)
            param.copy_(torch.randint(-2**31, 2**31 - 1, param.shape, generator=gen, dtype=torch.int32))
        layer.scales.copy_(torch.rand(layer.scales.shape, generator=gen) * 0.005)
        if cfg.method == "gptq":
            offset, group = _row_offset(layer), _group(layer, cfg)
            layer.g_idx.copy_(((torch.arange(layer.in_features) + offset) // group).expand_as(layer.g_idx))


def fill_int4_weights(model: nn.Module, config: Any, cfg: Int4CheckpointConfig, device: torch.device) -> None:
    """`make_int4_params`, the checkpoint (or ``load_format="dummy"``'s random values), `finish_int4_params`."""
    from asyncllm.models.loader import init_dummy_weights, load_checkpoint, materialize_params, resolve_model_path

    use_triton = device.type == "cuda"
    if use_triton and config.enable_lora:
        raise NotBuiltError("enable_lora", True, "LoRA adapters over AWQ / GPTQ layers on a GPU (their weights stay "
                                                 "packed; on the CPU they are dequantized and adapters work)")
    from asyncllm.models.int4_experts import draw_int4_experts, finish_int4_experts, make_int4_expert_params

    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)  # what stays unquantized
    make_int4_params(model, cfg)
    make_int4_expert_params(model, cfg)
    if config.load_format == "dummy":
        _draw_int4_weights(model, cfg, config.seed)
        draw_int4_experts(model, cfg, config.seed)
    else:
        materialize_params(model, device)  # the float parameters left (built on the meta device)
        load_checkpoint(model, resolve_model_path(config.model, config.revision), config.kv_cache_dtype,
                        functools.partial(drop_extra_biases, model), load_format=config.load_format)
    finish_int4_params(model, cfg, use_triton)
    finish_int4_experts(model, cfg, keep_packed=use_triton)  # packed on a GPU (the fused-MoE kernel's int path)
