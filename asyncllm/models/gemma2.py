"""Gemma 2 (2B, 9B, 27B): the Gemma decoder (asyncllm/models/gemma.py), sliding-window and global layers
alternating, attention scores capped to ``attn_logit_softcapping * tanh(score / attn_logit_softcapping)``.

VaultGemma (vaultgemma-1b, ``VaultGemmaForCausalLM``): Gemma 2's attention, caps and layer types with only the two
norms before the sublayers (``input_layernorm``, ``pre_feedforward_layernorm``): Gemma (1)'s layer shape."""

from __future__ import annotations

from typing import Iterable

from asyncllm.models.gemma import Gemma1Model, GemmaForCausalLM
from asyncllm.models.layers import LoadedWeight

__all__ = ["Gemma2ForCausalLM", "VaultGemmaForCausalLM"]


class Gemma2ForCausalLM(GemmaForCausalLM):
    caps_attention = True


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    """Gemma 2 without the norms after the sublayers; its norm before the MLP loads as Gemma (1)'s."""

    model_cls = Gemma1Model

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        renamed = ((name.replace(".pre_feedforward_layernorm.", ".post_attention_layernorm."), weight)
                   for name, weight in weights)
        return super().load_weights(renamed)
