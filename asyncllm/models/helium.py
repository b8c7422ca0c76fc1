"""Kyutai Helium (helium-1-2b, helium-1-preview-2b): ``HeliumForCausalLM``.

Llama's layers (asyncllm/models/llama.py) with Helium's differences:

- a rotary on interleaved pairs, run as half-split by reordering the q and k rows at load
  (`InterleavedRotaryLoading`, as GLM's and ERNIE's);
- every RMSNorm multiplies its weight in float32 and rounds once (`Olmo2RMSNorm`), as transformers' Helium does;
- q, k and v biases by ``attention_bias``, none on the output projection; MLP biases by ``mlp_bias``.
"""

from __future__ import annotations

from typing import Any

from asyncllm.models.glm4 import InterleavedRotaryLoading
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncllm.models.olmo2 import Olmo2RMSNorm

__all__ = ["HeliumForCausalLM"]


class HeliumDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with norms that round once (the fused decode products round as Llama's: not used)."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.input_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.fused_decode_rows = 0


class HeliumModel(LlamaModel):
    layer_cls = HeliumDecoderLayer
    norm_cls = Olmo2RMSNorm


class HeliumForCausalLM(InterleavedRotaryLoading, LlamaForCausalLM):
    """Llama's layers with Helium's norms and biases; its interleaved rotary reordered at load."""

    model_cls = HeliumModel

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(getattr(hf_config, "attention_bias", False)), o_bias=False,
                            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.reorder_rotary_rows(hf_config)
