"""Zhipu GLM-4 (glm-4-9b-chat-hf, ``GlmForCausalLM``) and GLM-4-0414 (GLM-4-9B/32B-0414, GLM-Z1; ``Glm4ForCausalLM``).

The Llama decoder (asyncllm/models/llama.py) with GLM's differences:

- rotary on the first half of each head only (``partial_rotary_factor`` 0.5), in *interleaved* pairs
  (dims 0-1, 2-3, ... turn together) where the backends' kernels turn half-split pairs (i, i + d/2). A
  rotation of interleaved pairs equals a half-split one of the same q and k with their rotary dims
  reordered (even ones first, then odd ones); attention only reads q . k, which one reordering of both leaves
  unchanged. So the q and k projection rows (and biases) are reordered once at load (`interleaved_to_half`),
  and the kernels run as for Llama;
- q, k and v with biases, o without (``attention_bias``);
- the checkpoint's ``gate_up_proj`` fused (gate rows, then up), cut at load as Phi-3's (`FusedCheckpointLoading`);
- GLM-4-0414 only: a norm after attention and after the MLP too (``post_self_attn_layernorm``,
  ``post_mlp_layernorm``), before each output joins the residual stream.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import LoadedWeight, RMSNorm, head_dim_of, norm_in
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncllm.models.phi3 import FusedCheckpointLoading, check_phi3
from asyncllm.models.rotary import rope_parameters

__all__ = ["Glm4ForCausalLM", "GlmForCausalLM", "InterleavedRotaryLoading", "interleaved_to_half"]


def interleaved_to_half(weight: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Rows of a q or k projection (weight or bias), head by head, with each head's first ``rotary_dim`` rows
    reordered from interleaved pairs to half-split ones: 0, 2, 4, ..., then 1, 3, 5, ...; the rest unchanged."""
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim, head_dim)])
    heads = weight.view(-1, head_dim, *weight.shape[1:])
    return heads[:, order].reshape(weight.shape)


class Glm4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with a norm on the attention's and the MLP's outputs before they join the residual stream."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.fused_decode_rows = 0  # the fused decode products know no post-sublayer norms

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = norm_in(self.input_layernorm, hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden, kv_cache, metadata))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4Model(LlamaModel):
    layer_cls = Glm4DecoderLayer


class InterleavedRotaryLoading:
    """For a decoder whose rotary turns interleaved pairs: the q and k projections' rows reordered at load
    (`interleaved_to_half`), so the backends' half-split rotary gives the same attention."""

    default_partial_rotary = 1.0
    """The rotated fraction of each head when the config names none (GLM: 0.5)."""

    def reorder_rotary_rows(self, hf_config: Any) -> None:
        """Read the head and rotary widths (call in ``__init__``); a pre-quantized checkpoint is a `NotBuiltError`
        (its packed q/k matrices and scales would need the same reordering)."""
        check_phi3(hf_config, type(self).__name__.removesuffix("ForCausalLM"))
        self.head_dim = head_dim_of(hf_config)
        partial = rope_parameters(hf_config).get("partial_rotary_factor", self.default_partial_rotary)
        self.rotary_dim = int(self.head_dim * partial)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((name, self._half_split(name, w)) for name, w in weights)  # type: ignore[misc]

    def lora_b_rows(self, name: str, weight: LoadedWeight) -> LoadedWeight:
        """An adapter's B rows reordered as the weight's (asyncllm/models/lora.py)."""
        return self._half_split(name, weight)

    def _half_split(self, name: str, weight: LoadedWeight) -> LoadedWeight:
        """q and k projections (read whole) with their rotary rows reordered."""
        if ".q_proj." not in name and ".k_proj." not in name:
            return weight
        tensor = weight if isinstance(weight, torch.Tensor) else weight[:]
        return interleaved_to_half(tensor, self.head_dim, self.rotary_dim)


class GlmForCausalLM(InterleavedRotaryLoading, FusedCheckpointLoading, LlamaForCausalLM):
    """GLM-4's causal LM: Llama's layers, interleaved partial rotary (reordered at load), fused gate_up."""

    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }
    default_partial_rotary = 0.5

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(getattr(hf_config, "attention_bias", True)), o_bias=False)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise NotBuiltError("model", hf_config.hidden_act, "GLM's MLP activation silu")
        super().__init__(hf_config, **kwargs)
        self.fused_parts = {"gate_up_proj": [(0, hf_config.intermediate_size), (1, hf_config.intermediate_size)]}
        self.reorder_rotary_rows(hf_config)


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414: GLM's layers with post-attention and post-MLP norms."""

    model_cls = Glm4Model
