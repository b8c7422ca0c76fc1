"""ALiBi attention (BLOOM, MPT, Falcon-RW): no rotation of q and k; each score gets its head's slope times the key's
distance from the query, ``slope_h * (key_pos - query_pos)``, which the backends add
(`asyncllm.kernels.reference.alibi_bias`, the Triton kernels' ``USE_ALIBI``).

The families differ in their slopes (`bloom_alibi_slopes`, `mpt_alibi_slopes`, `falcon_alibi_slopes`); all start from
Press et al.'s geometric series, and BLOOM's and MPT's agree for a power-of-two head count with MPT's default
``alibi_bias_max`` of 8 (Falcon-RW's are BLOOM's, rounded and scaled). Under tensor parallelism each rank holds the
slopes of its own heads (`AlibiAttention`). transformers adds ``slope_h * key_pos`` (BLOOM, Falcon) or
``slope_h * (key_pos - last_pos)`` (MPT) instead: a constant per query row, which softmax ignores, and the relative
form keeps the biases that matter small at any position. (Falcon's transformers code also rounds each
``slope_h * key_pos`` to bfloat16; that rounding is not reproduced: exact below 256 tokens for power-of-two slopes.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import Attention, TensorParallel, head_dim_of
from asyncllm.models.llama import DecoderBuild, LlamaAttention

__all__ = ["AlibiAttention", "AlibiBuild", "alibi_build", "bloom_alibi_slopes", "falcon_alibi_slopes",
           "mpt_alibi_slopes"]


def bloom_alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """BLOOM's: for the largest power of two p <= n heads, ``2 ** (-8 k / p)`` for k = 1 .. p; the n - p heads
    beyond take the odd-k slopes of 2p heads' series, ``2 ** (-4 k / p)`` for k = 1, 3, 5, ..."""
    p = 2 ** math.floor(math.log2(num_heads))
    extra = range(1, 2 * (num_heads - p), 2)
    return tuple(2.0 ** (-8.0 * k / p) for k in range(1, p + 1)) + tuple(2.0 ** (-4.0 * k / p) for k in extra)


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> tuple[float, ...]:
    """MPT's: for the smallest power of two p >= n heads, ``2 ** (-alibi_bias_max * k / p)`` for k = 1 .. p; with
    fewer heads than p, the odd-k slopes then the even-k ones, the first n of them."""
    p = 2 ** math.ceil(math.log2(num_heads))
    slopes = [2.0 ** (-alibi_bias_max * k / p) for k in range(1, p + 1)]
    return tuple((slopes[1::2] + slopes[::2])[:num_heads]) if p != num_heads else tuple(slopes)


def falcon_alibi_slopes(num_heads: int, head_dim: int) -> tuple[float, ...]:
    """Falcon-RW's: BLOOM's rounded to bfloat16 (as TII's code and transformers build them), over ``sqrt(head_dim)``:
    Falcon adds the bias to the raw scores and then scales both by the softmax scale."""
    rounded = torch.tensor(bloom_alibi_slopes(num_heads), dtype=torch.float32).bfloat16().double()
    return tuple((rounded / math.sqrt(head_dim)).tolist())


@dataclass(frozen=True)
class AlibiBuild(DecoderBuild):
    """A decoder's build with the slopes of every head (all ranks') and MPT's q/k/v clamp."""

    alibi_slopes: tuple[float, ...] = dataclasses.field(default=(), kw_only=True)
    clip_qkv: float | None = dataclasses.field(default=None, kw_only=True)
    """q, k and v clamped to ``[-clip_qkv, clip_qkv]`` after the projection (MPT's ``attn_config.clip_qkv``)."""


def alibi_build(family: Any, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                expert_parallel: bool, slopes: tuple[float, ...], clip_qkv: float | None = None) -> AlibiBuild:
    """``family``'s build (its flags and MLP) with no rotary embedding: ``slopes`` for every head, all ranks' (the
    family's rule: `bloom_alibi_slopes`, `mpt_alibi_slopes`, `falcon_alibi_slopes`)."""
    return AlibiBuild(hf_config, family.decoder_flags(hf_config), dtype, tp, attn_backend,
                      None, family.make_mlp, expert_parallel,  # type: ignore[arg-type]
                      alibi_slopes=slopes, clip_qkv=clip_qkv)


class AlibiAttention(LlamaAttention):
    """Llama's attention without rotary positions: its backend adds ALiBi's bias for this rank's heads."""

    def __init__(self, b: AlibiBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        qkv = self.qkv_proj
        first = b.tp.rank * qkv.num_heads  # this rank's query heads, as QKVParallelLinear splits them
        slopes = torch.tensor(b.alibi_slopes[first : first + qkv.num_heads], dtype=torch.float32)
        self.attn = Attention(qkv.num_heads, qkv.num_kv_heads, head_dim_of(b.hf_config), b.attn_backend,
                              scale=b.flags.attention_scale, alibi_slopes=slopes)
        self.clip = b.clip_qkv

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        query, key, value = self.qkv_proj.split_qkv(qkv)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata))
