"""Microsoft Phi-1, Phi-1.5 and Phi-2 (``PhiForCausalLM``).

GPT-J-style parallel layers (asyncllm/models/parallel_residual.py): one LayerNorm (with a bias) before attention and
the MLP, both outputs added to the stream; q, k, v and the output projection (``dense``) with biases; a partial
rotary (``partial_rotary_factor``: 0.5 for Phi-1 / 1.5, 0.4 for Phi-2, half-split within the rotated dims as the
backends turn them); a GELU MLP ``fc2(gelu_new(fc1(x)))``; a final LayerNorm (``final_layernorm``) and an LM head
with a bias. Their names are mapped to the shared layers' at load. ``qk_layernorm`` (no release sets it) is a
`NotBuiltError`.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM, LlamaModel
from asyncllm.models.parallel_residual import ParallelResidualLayer
from asyncllm.models.starcoder2 import BiasLayerNorm, GatelessMLP

__all__ = ["PhiForCausalLM", "renamed"]

_PHI_NAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.c_fc."), (".mlp.fc2.", ".mlp.c_proj."),
              ("model.final_layernorm.", "model.norm."))


def renamed(weights: Iterable[tuple[str, LoadedWeight]], pairs: Iterable[tuple[str, str]]
            ) -> Iterable[tuple[str, LoadedWeight]]:
    """``weights`` with each checkpoint name's first matching part of ``pairs`` replaced."""
    pairs = tuple(pairs)
    for name, weight in weights:
        for old, new in pairs:
            if old in name:
                name = name.replace(old, new)
                break
        yield name, weight


class PhiModel(LlamaModel):
    layer_cls = ParallelResidualLayer
    norm_cls = BiasLayerNorm


class PhiForCausalLM(LlamaForCausalLM):
    """Parallel layers with LayerNorms, biases everywhere, a partial rotary, a GELU MLP, a biased LM head."""

    model_cls = PhiModel
    lm_head_bias = True

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True, o_bias=True, mlp_bias=True)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GatelessMLP(b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "qk_layernorm", False):
            raise NotBuiltError("qk_layernorm", True, "Phi with LayerNorms on q and k")
        hf_config = copy.copy(hf_config)
        hf_config.rms_norm_eps = hf_config.layer_norm_eps  # every norm's eps, as the shared layers build them
        super().__init__(hf_config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(renamed(weights, _PHI_NAMES))
