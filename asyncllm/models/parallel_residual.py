"""GPT-J-style layers: attention and the MLP read the same residual stream and both outputs join it at once
(Phi-1 / 1.5 / 2, GPT-NeoX, StableLM's ``use_parallel_residual``), with LayerNorms that have biases.

`ParallelResidualLayer` returns (output, stream) as `LlamaDecoderLayer` does, the next norm (or the final one)
adding them, so the two outputs join the stream in the order transformers adds them (``mlp_first_join``)."""

from __future__ import annotations

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.llama import DecoderBuild, LlamaAttention
from asyncllm.models.starcoder2 import BiasLayerNorm

__all__ = ["ParallelResidualLayer"]


class ParallelResidualLayer(nn.Module):
    """``x + attn(norm(x)) + mlp(norm'(x))``: one norm for both (Phi, StableLM) or a second before the MLP
    (``post_attention_layernorm``: GPT-NeoX)."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    two_norms = False
    """Whether the MLP reads its own norm of the stream (GPT-NeoX) instead of the attention's input (Phi)."""
    attention_joins_first = False
    """``(x + attn) + mlp`` (StableLM) rather than ``(attn + mlp) + x`` (Phi, GPT-NeoX): the rounding order."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        self.input_layernorm = BiasLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.self_attn = self.attention_cls(b, layer_idx)
        if self.two_norms:
            self.post_attention_layernorm = BiasLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.mlp = b.make_mlp(b, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual
        normed = self.input_layernorm(stream)
        attn = self.self_attn(positions, normed, kv_cache, metadata)
        mlp = self.mlp(self.post_attention_layernorm(stream) if self.two_norms else normed)
        if self.attention_joins_first:
            return mlp, stream + attn
        return attn + mlp, stream
