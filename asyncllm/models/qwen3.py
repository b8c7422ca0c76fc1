"""Qwen3: the Llama decoder with RMSNorm on each query and key head before rotary,
no q/k/v bias by default, and an explicit ``head_dim`` (read by `head_dim_of`)."""

from __future__ import annotations

from typing import Any

from asyncllm.models.llama import DecoderFlags, LlamaForCausalLM

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)
