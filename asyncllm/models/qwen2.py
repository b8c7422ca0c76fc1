"""Qwen2 / Qwen2.5: the Llama decoder with biases on q, k, v (none on o_proj)."""

from __future__ import annotations

from typing import Any

from asyncllm.models.llama import DecoderFlags, LlamaForCausalLM

__all__ = ["Qwen2ForCausalLM"]


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True, o_bias=False)
