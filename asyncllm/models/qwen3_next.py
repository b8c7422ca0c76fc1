"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B Instruct / Thinking): Qwen3.5's hybrid
(asyncllm/models/qwen3_5.py) with Qwen3-MoE's experts and a gated shared expert, and its linear layers' input
projections fused per key head.

A checkpoint's ``in_proj_qkvz`` holds, for each key head, its query and key rows, then the value and gate rows of
its ``Hv / Hk`` value heads; ``in_proj_ba`` holds each key head's ``b`` rows then its ``a`` rows. They are cut at
load into Qwen3.5's ``in_proj_qkv`` (all queries, all keys, all values: the order the convolution's channels have
in both), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` (`split_qkvz`, `split_ba`), so the layer runs unchanged.
A block-fp8 checkpoint's ``in_proj_qkvz`` scales are cut the same way by block rows (each part a whole number of
blocks: the official FP8 release's 128-row parts are); an fp8 ``in_proj_ba`` (two rows per key head, less than a
block) is a `NotBuiltError`.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.moe import MoECausalLM, MoESpec
from asyncllm.models.qwen2_moe import shared_expert_moe_spec
from asyncllm.models.qwen3_5 import Qwen3_5ForCausalLM, without_mtp

__all__ = ["Qwen3NextForCausalLM", "split_ba", "split_qkvz"]

_FUSED_IN_CHECKPOINT = {"in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz", "in_proj_b": "in_proj_ba",
                        "in_proj_a": "in_proj_ba"}


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
        super().__init__(hf_config, **kwargs)
        heads = hf_config.linear_num_key_heads
        self.linear_shape = (heads, hf_config.linear_key_head_dim,
                             hf_config.linear_num_value_heads // heads * hf_config.linear_value_head_dim)
        """(Hk, Dk, r * Dv): how the fused projections group their rows."""
        quant = getattr(hf_config, "quantization_config", None) or {}
        block = quant.get("weight_block_size") if isinstance(quant, dict) else getattr(quant, "weight_block_size", None)
        self.fp8_block_rows = int(block[0]) if block else None
        """A block-fp8 checkpoint's block rows: the fused projections' scales are cut by them."""

    @staticmethod
    def checkpoint_module_name(module: str) -> str:
        """Where a quantized checkpoint names the projection (its fused ones: their quantization is one)."""
        prefix, _, leaf = module.rpartition(".")
        return f"{prefix}.{_FUSED_IN_CHECKPOINT.get(leaf, leaf)}"

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(self._split_fused(without_mtp(weights)))

    def _split_fused(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        for name, weight in weights:
            prefix, _, leaf = name.rpartition(".linear_attn.")
            if leaf in ("in_proj_qkvz.weight", "in_proj_qkvz.weight_scale_inv"):
                suffix = leaf.removeprefix("in_proj_qkvz")
                qkv, z = split_qkvz(_full(weight), *self._qkvz_rows(scales=suffix.endswith("scale_inv")))
                yield f"{prefix}.linear_attn.in_proj_qkv{suffix}", qkv
                yield f"{prefix}.linear_attn.in_proj_z{suffix}", z
            elif leaf == "in_proj_ba.weight":
                b, a = split_ba(_full(weight), self.linear_shape[0])
                yield f"{prefix}.linear_attn.in_proj_b.weight", b
                yield f"{prefix}.linear_attn.in_proj_a.weight", a
            elif leaf == "in_proj_ba.weight_scale_inv":
                raise NotBuiltError("model", name, "a Qwen3-Next checkpoint with in_proj_ba in fp8 (two rows per key "
                                                   "head: less than a weight block; the FP8 release leaves it float)")
            else:
                yield name, weight

    def _qkvz_rows(self, scales: bool) -> tuple[int, int, int]:
        """(Hk, Dk, r Dv) in rows, or (``scales``: ``weight_scale_inv``) in block rows."""
        heads, k_dim, v_rows = self.linear_shape
        if not scales:
            return heads, k_dim, v_rows
        block = self.fp8_block_rows or 1
        if k_dim % block or v_rows % block:
            raise ConfigError("model", "in_proj_qkvz", f"fp8 blocks of {block} rows that cut Qwen3-Next's fused "
                                                       f"projection into whole parts ({k_dim}, {v_rows} rows)")
        return heads, k_dim // block, v_rows // block


def _full(weight: LoadedWeight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight[:]
