"""Gemma 2 (2B, 9B, 27B): the Gemma decoder (asyncllm/models/gemma.py), sliding-window and global layers
alternating, attention scores capped to ``attn_logit_softcapping * tanh(score / attn_logit_softcapping)``."""

from __future__ import annotations

from asyncllm.models.gemma import GemmaForCausalLM

__all__ = ["Gemma2ForCausalLM"]


class Gemma2ForCausalLM(GemmaForCausalLM):
    caps_attention = True
