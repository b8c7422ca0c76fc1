"""Building blocks shared by the model families: tensor-parallel group, RMSNorm,
attention, and the weight-loading helpers the parallel layers use.

A checkpoint weight reaches a parameter through the parameter's ``weight_loader``
(set by the layer that owns it), which copies only this rank's shard. The
loaded weight may be a tensor or a lazy safetensors slice, so that a rank reads
only the bytes of its own shard.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Union

import torch
import torch.distributed as dist
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.attention.selector import AttentionBackend
from asyncllm.models.ops import REFERENCE_OPS, ModelOps

__all__ = [
    "TensorParallel",
    "LoadedWeight",
    "weight_shape",
    "weight_narrow",
    "check_whole_size",
    "copy_weight",
    "scalar_weight",
    "default_weight_loader",
    "set_weight_loader",
    "new_param",
    "params_on_meta",
    "head_dim_of",
    "kv_heads_per_rank",
    "RMSNorm",
    "norm_in",
    "Attention",
]

# A torch tensor, or a safetensors ``PySafeSlice`` (``get_shape()`` and ``[...]`` indexing).
LoadedWeight = Union[torch.Tensor, Any]
WeightLoader = Callable[..., None]


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group (torch.distributed's default group, or ``group``)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    """The TP ranks' process group: a pipeline stage's (asyncllm/models/pipeline.py); None: the default group."""

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, (self.rank, self.size)

    def check_group(self) -> None:
        """The collectives need the group (torch.distributed's default one, unless given) to be the TP ranks."""
        if self.size > 1:
            assert dist.is_initialized(), "torch.distributed must be initialised before a TP model is built"
            group = self.group
            assert (dist.get_world_size(group), dist.get_rank(group)) == (self.size, self.rank), "TP group mismatch"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (in place; x itself when alone)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim, rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, total: int) -> int:
        """This rank's share of ``total`` (which the caller has checked divides evenly)."""
        assert total % self.size == 0, (total, self.size)
        return total // self.size


def weight_shape(loaded: LoadedWeight) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def weight_narrow(loaded: LoadedWeight, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded[start:start+length]`` along ``dim``, reading only that part of a lazy slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = tuple([slice(None)] * dim + [slice(start, start + length)])
    return loaded[index]


def check_whole_size(loaded: LoadedWeight, dim: int, size: int) -> None:
    """ValueError unless the whole checkpoint tensor (a lazy slice: from its header) has `size` entries along `dim`:
    checked before a rank's slice is cut from it, so one too large is refused rather than loaded cut short."""
    shape = weight_shape(loaded)
    if dim < len(shape) and shape[dim] != size:
        raise ValueError(f"has shape {shape}, the model expects {size} along dimension {dim}")


def _full(loaded: LoadedWeight) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]  # [...]: scalars too


def copy_weight(dst: torch.Tensor, src: LoadedWeight) -> None:
    """Copy (and cast) src into dst; ValueError when the shapes differ."""
    src_tensor = _full(src)
    if tuple(dst.shape) != tuple(src_tensor.shape):
        raise ValueError(f"has shape {tuple(src_tensor.shape)}, the model expects {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src_tensor)


def scalar_weight(loaded: LoadedWeight) -> torch.Tensor:
    """A checkpoint's per-tensor scale as a 0-d tensor; ValueError when it holds more than one value."""
    value = _full(loaded)
    if value.numel() != 1:
        raise ValueError(f"has shape {tuple(value.shape)}, a per-tensor scale is a scalar")
    return value.reshape(())


def default_weight_loader(param: nn.Parameter, loaded: LoadedWeight) -> None:
    """A replicated parameter: every rank keeps the whole weight."""
    copy_weight(param.data, loaded)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


_PARAMS_ON_META = contextvars.ContextVar("params_on_meta", default=False)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside, `new_param` allocates on the meta device: a pre-quantized checkpoint's model is built without its
    float weights, which the quantized ones replace before any is allocated (loader.materialize_params)."""
    token = _PARAMS_ON_META.set(True)
    try:
        yield
    finally:
        _PARAMS_ON_META.reset(token)


def new_param(*shape: int, dtype: torch.dtype, loader: WeightLoader = default_weight_loader) -> nn.Parameter:
    """An uninitialised inference parameter (filled by the loader) on the current default device (the meta device
    inside `params_on_meta`)."""
    device = torch.device("meta") if _PARAMS_ON_META.get() else None
    return set_weight_loader(nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False), loader)


def head_dim_of(hf_config: Any) -> int:
    """The attention head size: explicit ``head_dim`` (Qwen3, Mistral) or hidden_size / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config: Any) -> int:
    """The KV head count: ``num_key_value_heads``, or one per attention head where the config names none
    (Nemotron's default)."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def kv_heads_per_rank(total_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: a share, or one replicated head when there are fewer heads than ranks."""
    return max(1, total_kv_heads // tp_size)


def norm_in(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first norm: (normed input, residual stream). The first layer's input opens the stream
    (``residual`` None); a later layer's joins it, inside the norm's fused add."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class RMSNorm(nn.Module):
    """RMSNorm with HF's rounding; ``forward(x, residual)`` fuses the residual add.

    ``ops`` are the kernels it runs (the attention backend's, see `ModelOps`).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: ModelOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.weight = new_param(hidden_size, dtype=dtype)
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Paged attention over this rank's heads; the math lives in the backend."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        attention_chunk_size: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        """``scale`` defaults to ``head_dim ** -0.5``; ``softcap`` caps the scores (Gemma 2; None: off);
        ``attention_chunk_size`` C keeps a query at position p to the keys from ``(p // C) * C`` on (Llama 4's
        chunked local attention; None: off). ValueError when given with ``sliding_window``. ``alibi_slopes``
        (this rank's heads' float32 slopes, ``[num_heads]``) biases each score by ``slope * (key_pos - query_pos)``
        (BLOOM's and MPT's ALiBi, asyncllm/models/alibi.py; None: off)."""
        if attention_chunk_size is not None and sliding_window is not None:
            raise ValueError(f"an attention layer has sliding_window ({sliding_window}) or attention_chunk_size "
                             f"({attention_chunk_size}), not both")
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.softcap = softcap or None
        self.attention_chunk_size = attention_chunk_size
        self.alibi_slopes: torch.Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.k_scale = 1.0
        self.v_scale = 1.0
        """Calibrated fp8 KV-cache scales (asyncllm/models/kv_scales.py): the cache holds ``k / k_scale`` and
        ``v / v_scale``; 1.0 unless an fp8 cache's checkpoint gives them."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rotary: RotaryInputs | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` (rotated by the backend when ``rotary``
        is given, so it can fuse that with the KV-cache write) -> ``[T, Hq * D]``. ``sinks`` (this rank's
        ``[Hq]`` sink logits, gpt-oss) is the caller's parameter, so the checkpoint names it where it is. ``key`` and
        ``value`` None (with ``rotary`` None, the query rotated): attend over ``kv_cache`` as another layer wrote it
        (Gemma 4's KV-sharing layers)."""
        scale = self.scale
        if self.k_scale != 1.0 or self.v_scale != 1.0:
            query, key, value, rotary, scale = self._scaled(query, key, value, rotary)
        out = self.backend.forward(query, key, value, kv_cache, metadata, scale, self.sliding_window, rotary,
                                   self.softcap, sinks, attention_chunk_size=self.attention_chunk_size,
                                   alibi_slopes=self.alibi_slopes)
        if self.v_scale != 1.0:
            out = out * self.v_scale
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _scaled(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                rotary: RotaryInputs | None) -> tuple[Any, ...]:
        """The inputs for a cache holding ``k / k_scale`` and ``v / v_scale``: the keys divided (through the key
        norm's weight where the backend norms them: the norm would undo a division before it), the values divided,
        the scores' scale times ``k_scale`` (and the output times ``v_scale``, after): the same attention. No keys
        and values (a layer that reads another layer's cache, with that layer's scales): the scales alone."""
        if key is None or value is None:
            return query, key, value, rotary, self.scale * self.k_scale
        if rotary is not None and rotary.k_norm_weight is not None:
            rotary = rotary._replace(k_norm_weight=rotary.k_norm_weight / self.k_scale)
        else:
            key = key / self.k_scale
        return query, key, value / self.v_scale, rotary, self.scale * self.k_scale

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend.name}, sliding_window={self.sliding_window}"
            + ("" if self.softcap is None else f", softcap={self.softcap}")
            + ("" if self.attention_chunk_size is None else f", attention_chunk_size={self.attention_chunk_size}")
        )
