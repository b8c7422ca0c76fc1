"""IBM Granite 3.x dense models (3.0, 3.1, 3.2, 3.3; 2B and 8B): ``GraniteForCausalLM``.

The Llama decoder (asyncllm/models/llama.py) with four scalars from the config, each where transformers
applies it, so greedy outputs stay equal to its:

- ``embedding_multiplier``: the token embeddings are multiplied by it (`GraniteEmbedding`), and so are a prompt's
  own embedding rows (`GraniteForCausalLM.scale_prompt_embeds`: transformers scales ``inputs_embeds`` in forward);
- ``attention_multiplier``: the attention scale, instead of ``head_dim ** -0.5`` (`DecoderFlags.attention_scale`);
- ``residual_multiplier``: each attention and MLP output is multiplied by it before it joins the residual
  stream (`DecoderFlags.residual_multiplier`, applied by `LlamaDecoderLayer.to_residual` before the fused
  residual-add + RMSNorm and before the fused decode products' add, so every path of the triton backend
  takes it);
- ``logits_scaling``: the LM head's logits are divided by it (`GraniteForCausalLM.compute_logits`, which
  sampling, logprobs, prompt logprobs and the draft model all go through).

Tied embeddings (every Granite 3.x checkpoint) tie the LM head to the unscaled embedding matrix, as in
transformers: the multiplier is applied to the looked-up rows, never stored in the weight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncllm.models.embedding import VocabParallelEmbedding
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM, LlamaModel

__all__ = ["GraniteEmbedding", "GraniteForCausalLM"]


class GraniteEmbedding(VocabParallelEmbedding):
    """Token embeddings times ``multiplier`` (set by `GraniteModel`): a Python float, so the product is rounded
    to the dtype once, as transformers' ``inputs_embeds * embedding_multiplier``."""

    multiplier = 1.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.multiplier


class GraniteModel(LlamaModel):
    embedding_cls = GraniteEmbedding

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        self.embed_tokens.multiplier = float(b.hf_config.embedding_multiplier)


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite's causal LM: Llama's layers with Granite's four multipliers."""

    model_cls = GraniteModel

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return dataclasses.replace(super().decoder_flags(hf_config),
                                   attention_scale=float(hf_config.attention_multiplier),
                                   residual_multiplier=float(hf_config.residual_multiplier))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.logits_scaling = float(hf_config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits divided by ``logits_scaling`` in the model dtype first, as
        transformers does (then every sampler, logprob and draft path sees the scaled logits)."""
        return (self.lm_head(hidden) / self.logits_scaling).float()

    def scale_prompt_embeds(self, rows: torch.Tensor) -> torch.Tensor:
        """A prompt given as embeddings (transformers' ``get_input_embeddings()(ids)``: rows without the
        multiplier) times ``embedding_multiplier``, as the token rows are (workers/prompt_embeds.py calls it)."""
        return rows * self.model.embed_tokens.multiplier
