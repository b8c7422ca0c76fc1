"""Which parallel linear layers a pre-quantized checkpoint quantized, and the checkpoint tensors stacked in each.

Shared by the pre-quantized formats (asyncllm/models/fp8_checkpoint.py, int4_checkpoint.py, compressed_tensors.py):
a fused layer (``qkv_proj``, ``gate_up_proj``) holds several checkpoint modules, each its own shard with its own
scales.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

from asyncllm.errors import ConfigError
from asyncllm.models.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

__all__ = ["checkpoint_modules", "keep_float", "quantized_layers", "output_partitions", "shard_index"]


def keep_float(layer: LinearBase) -> LinearBase:
    """Mark a layer that stays float in every pre-quantized checkpoint whatever its quantization_config lists (an
    MTP layer's entry projection: vLLM builds DeepSeek's ``eh_proj`` as a plain ``nn.Linear``, and the released
    DeepSeek-V3 and Qwen3-Next fp8 checkpoints store it and ``mtp.fc`` in bf16); `quantized_layers` passes it
    over, and so does online fp8 (`quantization.quantize_fp8_linears`)."""
    layer.keeps_float = True
    return layer


def checkpoint_modules(model: nn.Module, name: str) -> list[str]:
    """The checkpoint's module names loaded into the model's module ``name`` (q/k/v_proj for a qkv_proj), as the
    checkpoint names them (a model whose module names differ says how: ``checkpoint_module_name``)."""
    leaf = name.rsplit(".", 1)[-1]
    parts = getattr(model, "packed_modules", {}).get(leaf)
    names = [name[: -len(leaf)] + part for part, _ in parts] if parts else [name]
    rename = getattr(model, "checkpoint_module_name", None)
    return [rename(module) for module in names] if rename is not None else names


def quantized_layers(model: nn.Module, is_ignored: Callable[[str], bool]) -> Iterator[tuple[str, LinearBase]]:
    """(name, layer) of every parallel linear the checkpoint quantized (``is_ignored``: the checkpoint left that
    module unquantized); `ConfigError` for a fused layer whose parts are ignored in part (they would need two
    formats in one matmul)."""
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or getattr(module, "keeps_float", False):
            continue
        ignored = [is_ignored(part) for part in checkpoint_modules(model, name)]
        if all(ignored):
            continue
        if any(ignored):
            raise ConfigError("model", name, "a quantization_config that ignores all the projections fused in "
                                             f"{name} or none of them ({checkpoint_modules(model, name)})")
        yield name, module


def output_partitions(layer: LinearBase) -> list[int]:
    """This rank's row counts of each checkpoint tensor stacked in the layer, in order."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.output_sizes_per_rank)
    assert isinstance(layer, (ColumnParallelLinear, RowParallelLinear)), type(layer)
    return [layer.weight.shape[0]]


def shard_index(layer: LinearBase, shard_id: object) -> int:
    """The position of the checkpoint tensor ``shard_id`` (q/k/v, or a merged layer's index) among the layer's."""
    if isinstance(layer, QKVParallelLinear):
        return "qkv".index(str(shard_id))
    return 0 if shard_id is None else int(shard_id)  # type: ignore[call-overload]
