"""LG AI Research EXAONE 4.0 (EXAONE-4.0-1.2B, EXAONE-4.0-32B): ``Exaone4ForCausalLM``.

OLMo 2's layer shape (asyncllm/models/olmo2.py: no norm before attention or the MLP,
each sublayer's output normed and added to the residual stream) with
Qwen3's per-head q/k RMSNorm (the backends' fused norm-and-rotate), Llama's
RMSNorm rounding, and a hybrid attention: with a ``sliding_window``, three
sliding-window layers to each full one (``layer_types``), and only the sliding
ones rotate (the full layers use no positions: an identity table,
`with_rope_only_in`); without one, every layer is full and rotates.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.attention.selector import AttentionBackend
from asyncllm.models.layers import RMSNorm, TensorParallel
from asyncllm.models.llama import (
    DecoderBuild,
    DecoderFlags,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    with_rope_only_in,
)
from asyncllm.models.olmo2 import Olmo2DecoderLayer

__all__ = ["Exaone4ForCausalLM"]


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    attention_cls = LlamaAttention
    norm_cls = RMSNorm


class Exaone4Model(LlamaModel):
    layer_cls = Exaone4DecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    """OLMo 2's layers with per-head q/k norms; the full-attention layers of a hybrid model turn by nothing."""

    model_cls = Exaone4Model

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        if getattr(hf_config, "sliding_window", None) is None:
            return build
        return with_rope_only_in(build, [kind == "sliding_attention" for kind in hf_config.layer_types], max_position)
