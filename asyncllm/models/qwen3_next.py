"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B Instruct / Thinking): Qwen3.5's hybrid
(asyncllm/models/qwen3_5.py) with Qwen3-MoE's experts and a gated shared expert, and its linear layers' input
projections fused per key head.

A checkpoint's ``in_proj_qkvz`` holds, for each key head, its query and key rows, then the value and gate rows of
its ``Hv / Hk`` value heads; ``in_proj_ba`` holds each key head's ``b`` rows then its ``a`` rows. They are cut at
load into Qwen3.5's ``in_proj_qkv`` (all queries, all keys, all values: the order the convolution's channels have
in both), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` (`split_qkvz`, `split_ba`), so the layer runs unchanged.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from asyncllm.models.layers import LoadedWeight
from asyncllm.models.moe import MoECausalLM, MoESpec
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.qwen2_moe import shared_expert_moe_spec
from asyncllm.models.qwen3_5 import Qwen3_5ForCausalLM

__all__ = ["Qwen3NextForCausalLM", "split_ba", "split_qkvz"]


def split_qkvz(weight: torch.Tensor, num_k_heads: int, k_dim: int,
               v_rows_per_k_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``in_proj_qkvz`` ``[Hk * (2 Dk + 2 r Dv), H]`` -> (``in_proj_qkv`` rows: queries, keys, values; ``in_proj_z``)."""
    grouped = weight.view(num_k_heads, -1, weight.shape[-1])
    q, k, v, z = grouped.split([k_dim, k_dim, v_rows_per_k_head, v_rows_per_k_head], dim=1)
    flat = [part.reshape(-1, weight.shape[-1]) for part in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def split_ba(weight: torch.Tensor, num_k_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``in_proj_ba`` ``[Hk * 2r, H]`` -> (``in_proj_b``, ``in_proj_a``), each ``[Hv, H]`` in value-head order."""
    b, a = weight.view(num_k_heads, 2, -1, weight.shape[-1]).unbind(1)
    return b.reshape(-1, weight.shape[-1]), a.reshape(-1, weight.shape[-1])


class Qwen3NextForCausalLM(MoECausalLM, Qwen3_5ForCausalLM):
    """Qwen3.5's layers, Qwen3-MoE's routing (renormalized when ``norm_topk_prob``) with a gated shared expert."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        return shared_expert_moe_spec(hf_config, layer_idx)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Qwen3-Next")  # its fused projections are cut at load, their scales would need it too
        super().__init__(hf_config, **kwargs)
        heads = hf_config.linear_num_key_heads
        self.linear_shape = (heads, hf_config.linear_key_head_dim,
                             hf_config.linear_num_value_heads // heads * hf_config.linear_value_head_dim)
        """(Hk, Dk, r * Dv): how the fused projections group their rows."""

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        for name, weight in weights:
            if name.endswith(".linear_attn.in_proj_qkvz.weight"):
                prefix = name.removesuffix("in_proj_qkvz.weight")
                qkv, z = split_qkvz(_full(weight), *self.linear_shape)
                yield prefix + "in_proj_qkv.weight", qkv
                yield prefix + "in_proj_z.weight", z
            elif name.endswith(".linear_attn.in_proj_ba.weight"):
                prefix = name.removesuffix("in_proj_ba.weight")
                b, a = split_ba(_full(weight), self.linear_shape[0])
                yield prefix + "in_proj_b.weight", b
                yield prefix + "in_proj_a.weight", a
            else:
                yield name, weight


def _full(weight: LoadedWeight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight[:]
