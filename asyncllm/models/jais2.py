"""Inception Jais 2 (Jais-2-8B, -Chat): ``Jais2ForCausalLM``.

Nemotron's layers (asyncllm/models/nemotron.py: Llama's attention with biases by ``attention_bias``, a gateless
squared-ReLU MLP with biases by ``mlp_bias``) under plain LayerNorms with biases (``layer_norm_eps``).
"""

from __future__ import annotations

import copy
from typing import Any

from asyncllm.models.llama import LlamaModel
from asyncllm.models.nemotron import NemotronForCausalLM
from asyncllm.models.starcoder2 import BiasLayerNorm, Starcoder2DecoderLayer

__all__ = ["Jais2ForCausalLM"]


class Jais2Model(LlamaModel):
    layer_cls = Starcoder2DecoderLayer
    norm_cls = BiasLayerNorm


class Jais2ForCausalLM(NemotronForCausalLM):
    """Nemotron's attention and MLP under LayerNorms with biases."""

    model_cls = Jais2Model

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        config = copy.copy(hf_config)
        config.norm_eps = hf_config.layer_norm_eps  # Nemotron's name for it
        super().__init__(config, **kwargs)
