"""OpenBMB MiniCPM3 (MiniCPM3-4B): ``MiniCPM3ForCausalLM``.

DeepSeek-V2's multi-head latent attention over the latent cache (asyncllm/models/deepseek.py: the low-rank query,
``kv_a_proj_with_mqa``'s latent and shared rotary key, ``kv_b_proj`` absorbed per head) with the plain half-split
rotary (its config has no ``rope_interleave``, so `DeepseekAttention.interleaved` is off), over a dense SiLU MLP in
every layer, and muP's three scalars, each where transformers applies it (Granite's hooks, asyncllm/models/granite.py):

- ``scale_emb``: the token embeddings are multiplied by it (`GraniteEmbedding`), rounded to the model dtype first,
  as transformers' ``embed_scale.to(weight.dtype)``;
- ``scale_depth / sqrt(num_hidden_layers)``: each attention and MLP output is multiplied by it before it joins the
  residual stream (`DecoderFlags.residual_multiplier`);
- ``hidden_size / dim_model_base`` (transformers' ``logits_scaling``): the final hidden state is divided by it
  before the LM head (`MiniCPM3ForCausalLM.compute_logits`, which sampling, logprobs and prompt logprobs go
  through).

A tied LM head is the unscaled embedding matrix, as in transformers. MiniCPM3-4B's LongRoPE rotates every position
with one set of factors, chosen by ``max_model_len`` (`fix_longrope_factors`, as Phi-3's: docs/phi3.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from asyncllm.models.deepseek import DeepseekModel, DeepseekV2ForCausalLM
from asyncllm.models.granite import GraniteEmbedding
from asyncllm.models.llama import DecoderBuild, DecoderFlags
from asyncllm.models.moe import MoESpec
from asyncllm.models.rotary import fix_longrope_factors

__all__ = ["MiniCPM3ForCausalLM", "logits_scaling", "residual_scale"]


def residual_scale(hf_config: Any) -> float:
    """Each sublayer's output factor: ``scale_depth / sqrt(num_hidden_layers)`` (no ``scale_depth``: 1)."""
    depth = getattr(hf_config, "scale_depth", None)
    layers = hf_config.num_hidden_layers
    return (math.sqrt(layers) if depth is None else float(depth)) / math.sqrt(layers)


def logits_scaling(hf_config: Any) -> float:
    """The final hidden state's divisor: ``hidden_size / dim_model_base`` (no ``dim_model_base``: 1). Read from its
    parts: transformers' ``logits_scaling`` is a property, which the workers' plain config does not carry."""
    base = getattr(hf_config, "dim_model_base", None)
    return hf_config.hidden_size / (base or hf_config.hidden_size)


class MiniCPM3Model(DeepseekModel):
    embedding_cls = GraniteEmbedding

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__(b)
        scale = float(getattr(b.hf_config, "scale_emb", 1.0))
        self.embed_tokens.multiplier = torch.tensor(scale, dtype=b.dtype, device="cpu").item()


class MiniCPM3ForCausalLM(DeepseekV2ForCausalLM):
    """MiniCPM3's causal LM: latent attention with a half-split rope, dense MLPs, the three muP scalars."""

    model_cls = MiniCPM3Model
    takes_max_model_len = True
    """The loader passes ``max_model_len``: it chooses LongRoPE's factors."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        return None  # a dense MLP in every layer

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return dataclasses.replace(super().decoder_flags(hf_config), residual_multiplier=residual_scale(hf_config))

    def __init__(self, hf_config: Any, *, max_position: int, max_model_len: int | None = None, **kwargs: Any) -> None:
        """``max_model_len`` None (a direct build; the engine passes its own): ``max_position``."""
        hf_config = fix_longrope_factors(hf_config, max_model_len or max_position)
        super().__init__(hf_config, max_position=max_position, **kwargs)
        self.logits_scaling = logits_scaling(hf_config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits of the hidden states divided by ``logits_scaling`` in the model dtype,
        as transformers divides them before its LM head."""
        return self.lm_head(hidden / self.logits_scaling).float()
