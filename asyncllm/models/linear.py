"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split their output features across ranks and need no
communication; row-parallel layers split their input features and sum the
partial products with an all_reduce. Fused projections (``qkv_proj``,
``gate_up_proj``) load each checkpoint matrix (q/k/v, gate/up) into its slice of
this rank's shard through a ``weight_loader(param, loaded, shard_id)``.

Every layer computes its product through `LinearBase.matmul`: ``F.linear`` on the
model-dtype weight, or, once asyncllm/models/quantization.py has quantized the
weight after loading (``quantization="fp8"``), the layer's ``quant_method``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models.layers import (
    LoadedWeight,
    TensorParallel,
    check_whole_size,
    copy_weight,
    kv_heads_per_rank,
    new_param,
    weight_narrow,
)

__all__ = ["LinearBase", "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
           "RowParallelLinear"]


class LinearBase(nn.Module):
    """What every parallel linear layer shares: its model dtype and how its product is computed."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.params_dtype = dtype
        """The model dtype: the weight's until it is quantized, the activations' and the bias's always."""
        self.quant_method: Any = None
        """None: ``F.linear`` on the weight. Set after loading by asyncllm/models/quantization.py
        (``quantization="fp8"``): an object whose ``apply(layer, x, bias)`` computes ``x W^T + b`` from the
        layer's quantized ``weight`` and its ``weight_scale``."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` on this rank's shard."""
        if self.quant_method is None:
            return F.linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)


class _ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with this rank's ``output_size_per_rank`` rows of W and b."""

    def __init__(self, input_size: int, output_size_per_rank: int, bias: bool, tp: TensorParallel, dtype: torch.dtype):
        super().__init__(dtype)
        self.tp = tp
        self.output_size_per_rank = output_size_per_rank
        self.weight = new_param(output_size_per_rank, input_size, dtype=dtype, loader=self.weight_loader)
        self.bias = new_param(output_size_per_rank, dtype=dtype, loader=self.weight_loader) if bias else None
        self.lora: nn.Module | None = None
        """The adapters' products added to the output (asyncllm/models/lora.py; enable_lora only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora(x, out)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: object = None) -> None:
        """Copy rows of the checkpoint matrix into a slice of this rank's rows; a matrix (or bias) whose whole row
        count is not the projection's is a ValueError before any slice is cut (a larger one would load cut short)."""
        check_whole_size(loaded, 0, self._checkpoint_rows(shard_id))
        dst_offset, src_offset, length = self._shard_rows(shard_id)
        src = weight_narrow(loaded, 0, src_offset, length)
        copy_weight(param.data.narrow(0, dst_offset, length), src)

    def _shard_rows(self, shard_id: object) -> tuple[int, int, int]:
        """(offset in this rank's param, offset in the checkpoint matrix, row count)."""
        raise NotImplementedError

    def _checkpoint_rows(self, shard_id: object) -> int:
        """The rows of the whole checkpoint matrix `shard_id` names (every rank's)."""
        raise NotImplementedError


class ColumnParallelLinear(_ColumnParallelLinear):
    """One projection split by output features: rank r keeps rows ``[r * n / tp, (r + 1) * n / tp)``.

    Its checkpoint matrix loads unfused (no shard id). Splitting a projection whose rows
    are attention heads (``head_dim`` rows each, in head order) splits it by heads.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel, dtype: torch.dtype):
        super().__init__(input_size, tp.split(output_size), bias, tp, dtype)

    def _shard_rows(self, shard_id: object) -> tuple[int, int, int]:
        assert shard_id is None, shard_id
        length = self.output_size_per_rank  # (not the weight's rows: a quantized layer's weight is packed or gone)
        return 0, self.tp.rank * length, length

    def _checkpoint_rows(self, shard_id: object) -> int:
        return self.output_size_per_rank * self.tp.size


class MergedColumnParallelLinear(_ColumnParallelLinear):
    """Several column-parallel projections of the same input stacked in one matmul (gate_up_proj).

    Shard ``i`` of the checkpoint (``output_sizes[i]`` rows) is split across ranks;
    each rank stores its part of shard 0, then its part of shard 1, and so on.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallel, dtype: torch.dtype):
        self.output_sizes_per_rank = [tp.split(size) for size in output_sizes]
        super().__init__(input_size, sum(self.output_sizes_per_rank), bias, tp, dtype)

    def _shard_rows(self, shard_id: object) -> tuple[int, int, int]:
        assert isinstance(shard_id, int)
        length = self.output_sizes_per_rank[shard_id]
        return sum(self.output_sizes_per_rank[:shard_id]), self.tp.rank * length, length

    def _checkpoint_rows(self, shard_id: object) -> int:
        assert isinstance(shard_id, int)
        return self.output_sizes_per_rank[shard_id] * self.tp.size


class QKVParallelLinear(_ColumnParallelLinear):
    """The fused q, k, v projection, split by attention heads.

    Each rank keeps ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads;
    when there are fewer KV heads than ranks, each KV head is replicated on
    ``tp / num_kv_heads`` consecutive ranks (GQA keeps working inside a rank).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
    ):
        self.head_dim = head_dim
        self.num_heads = tp.split(total_num_heads)
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp.size)
        self.kv_head_start = (
            tp.rank * self.num_kv_heads if total_num_kv_heads >= tp.size else tp.rank * total_num_kv_heads // tp.size
        )
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.total_sizes = {"q": total_num_heads * head_dim, "k": total_num_kv_heads * head_dim,
                            "v": total_num_kv_heads * head_dim}
        """Each of q, k, v's whole checkpoint rows (every rank's)."""
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, tp, dtype)

    def _shard_rows(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id == "q":
            return 0, self.tp.rank * self.q_size, self.q_size
        start = self.kv_head_start * self.head_dim
        if shard_id == "k":
            return self.q_size, start, self.kv_size
        assert shard_id == "v", shard_id
        return self.q_size + self.kv_size, start, self.kv_size

    def _checkpoint_rows(self, shard_id: object) -> int:
        return self.total_sizes[shard_id]  # type: ignore[index]

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, q+2kv]`` -> q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (views)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = qkv.shape[0]
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )


class RowParallelLinear(LinearBase):
    """``y = all_reduce(x_rank W_rank^T) + b``: W split by input columns, b kept whole.

    The input ``x_rank`` is this rank's slice of the features (the output of a
    column-parallel layer), so no scatter is needed.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel, dtype: torch.dtype):
        super().__init__(dtype)
        self.tp = tp
        self.input_size_per_rank = tp.split(input_size)
        self.weight = new_param(output_size, self.input_size_per_rank, dtype=dtype, loader=self.weight_loader)
        self.bias = new_param(output_size, dtype=dtype) if bias else None
        self.lora: nn.Module | None = None
        """The adapters' products added to this rank's partial output (asyncllm/models/lora.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            out = self.matmul(x, self.bias)
            return out if self.lora is None else self.lora(x, out)
        out = self.matmul(x, None)
        out = self.tp.all_reduce(out if self.lora is None else self.lora(x, out))
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        """This rank's columns of the checkpoint matrix (the bias uses the default loader); a matrix whose whole
        column count is not the projection's is a ValueError before any slice is cut."""
        check_whole_size(loaded, 1, self.input_size_per_rank * self.tp.size)
        start = self.tp.rank * self.input_size_per_rank
        copy_weight(param.data, weight_narrow(loaded, 1, start, self.input_size_per_rank))
