"""Stability AI StableLM (stablelm-3b-4e1t, stablelm-2-1_6b / zephyr, stablelm-zephyr-3b, StableCode):
``StableLmForCausalLM``.

Llama's attention and gated SiLU MLP (asyncllm/models/llama.py) under LayerNorms with biases (``layer_norm_eps``);
q, k and v biases by ``use_qkv_bias``; a partial rotary (``partial_rotary_factor``, 0.25), half-split within the
rotated dims as the backends turn them. ``use_parallel_residual`` (stablelm-2-12b) runs attention and the MLP side
by side from one norm (asyncllm/models/parallel_residual.py); its per-head q/k LayerNorms (``qk_layernorm``) are a
`NotBuiltError`.
"""

from __future__ import annotations

import copy
from typing import Any

from asyncllm.errors import NotBuiltError
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM, LlamaModel
from asyncllm.models.parallel_residual import ParallelResidualLayer
from asyncllm.models.starcoder2 import BiasLayerNorm, Starcoder2DecoderLayer

__all__ = ["StableLmForCausalLM"]


class StableLmParallelLayer(ParallelResidualLayer):
    attention_joins_first = True


class StableLmModel(LlamaModel):
    norm_cls = BiasLayerNorm

    def __init__(self, b: DecoderBuild) -> None:
        parallel = bool(getattr(b.hf_config, "use_parallel_residual", False))
        self.layer_cls = StableLmParallelLayer if parallel else Starcoder2DecoderLayer
        super().__init__(b)


class StableLmForCausalLM(LlamaForCausalLM):
    """Llama's layers under LayerNorms with biases; parallel attention and MLP when the config says so."""

    model_cls = StableLmModel

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(getattr(hf_config, "use_qkv_bias", False)))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "qk_layernorm", False):
            raise NotBuiltError("qk_layernorm", True, "StableLM with per-head LayerNorms on q and k")
        hf_config = copy.copy(hf_config)
        hf_config.rms_norm_eps = hf_config.layer_norm_eps  # every norm's eps, as the shared layers build them
        super().__init__(hf_config, **kwargs)
