"""Hugging Face SmolLM3 (SmolLM3-3B, base and instruct): ``SmolLM3ForCausalLM``.

The Llama decoder (asyncllm/models/llama.py) in which some layers use no
positions at all: ``no_rope_layers[i] == 0`` (every fourth layer in SmolLM3-3B,
transformers' default) skips the rotary embedding there. Those layers rotate
by an identity table (`with_rope_only_in`: cos 1, sin 0, exact), so the attention
backends, their fused rotary and KV-write kernels and CUDA graphs run unchanged.
Sliding-window layers (``use_sliding_window``) follow ``layer_types`` as Qwen2's do.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.attention.selector import AttentionBackend
from asyncllm.errors import ConfigError
from asyncllm.models.layers import TensorParallel
from asyncllm.models.llama import DecoderBuild, LlamaForCausalLM, with_rope_only_in

__all__ = ["SmolLM3ForCausalLM"]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's layers; those with ``no_rope_layers[i] == 0`` turn their q and k by nothing."""

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        uses_rope = list(hf_config.no_rope_layers)
        if len(uses_rope) != hf_config.num_hidden_layers or set(uses_rope) - {0, 1}:
            raise ConfigError("no_rope_layers", uses_rope, f"one 0 or 1 per layer ({hf_config.num_hidden_layers})")
        return with_rope_only_in(build, [bool(use) for use in uses_rope], max_position)
