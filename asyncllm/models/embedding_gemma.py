"""EmbeddingGemma (``Gemma3TextModel`` with ``use_bidirectional_attention``): Gemma 3's text layers as a
bidirectional encoder for embeddings (google/embeddinggemma-300m). A ``Gemma3TextModel`` without it is Gemma 3's
causal decoder, served as every bare decoder is (`gemma3_text_model` chooses; docs/embeddings.md).

The layers, norms, rotary embeddings (one per layer type) and weight names are Gemma 3's (asyncllm/models/gemma.py,
gemma3.py; a bare ``Gemma3TextModel`` checkpoint, read through `headless`: no ``model.`` prefix, no LM head); only
the attention differs: every token of a prompt sees every other, in the sliding layers those less than
``sliding_window // 2 + 1`` away on either side (transformers' bidirectional window: 257 for config.json's 512), so
each prompt is computed whole in one step without a KV cache, as the BERT-family encoders are
(asyncllm/models/encoder.py; docs/embeddings.md). Its sentence-transformers pipeline (mean
pooling, two Dense projections, the norm) is applied after the model (asyncllm/models/st_dense.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.kernels import reference
from asyncllm.models.architectures import serves_as_encoder
from asyncllm.models.encoder import prompt_spans
from asyncllm.models.gemma3 import Gemma3ForCausalLM
from asyncllm.models.registry import _MODELS, headless

__all__ = ["BidirectionalAttention", "EmbeddingGemmaModel", "bidirectional_window", "gemma3_text_model"]


class BidirectionalAttention(nn.Module):
    """`Attention`'s interface over whole prompts: no KV cache, no causal mask; a window keeps the keys less than
    ``window`` positions away on either side."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.scale = window, scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, rotary: RotaryInputs | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if rotary is not None:
            query, key = reference.norm_and_rotate(query, key, rotary)
        out = torch.empty_like(query)
        for start, end in prompt_spans(metadata):
            mask = None
            if self.window is not None:
                index = torch.arange(end - start, device=query.device)
                mask = (index[:, None] - index[None, :]).abs() < self.window
            out[start:end] = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1), key[start:end].transpose(0, 1), value[start:end].transpose(0, 1),
                attn_mask=mask, scale=self.scale, enable_gqa=True).transpose(0, 1)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)


def bidirectional_window(hf_config: Any) -> int:
    """The sliding layers' reach: keys less than ``sliding_window // 2 + 1`` positions away, from config.json's
    ``sliding_window`` (transformers' config converts it so on load and writes the unconverted value back: both a
    loaded config and the workers' copy of it give that value through ``to_dict``)."""
    return int(hf_config.to_dict()["sliding_window"]) // 2 + 1


def gemma3_text_model(hf_config: Any) -> type:
    """``Gemma3TextModel``'s class by its config (the registry's variant): EmbeddingGemma where `serves_as_encoder`
    (``use_bidirectional_attention``), else Gemma 3's causal decoder as a bare decoder (`HEADLESS_BASES`), as vLLM
    serves it: an embedding model, LAST pooling by default."""
    return EmbeddingGemmaModel if serves_as_encoder("Gemma3TextModel", hf_config) else _MODELS["Gemma3TextModel"]


class EmbeddingGemmaModel(headless(Gemma3ForCausalLM)):  # type: ignore[misc]
    """Gemma 3's bare text model with bidirectional attention over whole prompts; its output is the final-normed
    hidden states (embeddings only: no LM head is read)."""

    is_encoder = True

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        config = copy.copy(hf_config)
        config.use_bidirectional_attention = False  # Gemma's causal decoder refuses it; its attention is swapped here
        super().__init__(config, **kwargs)
        self.vocab_size = hf_config.vocab_size
        window = bidirectional_window(hf_config)
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            layer.self_attn.attn = BidirectionalAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                          None if attn.sliding_window is None else window, attn.scale)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As the decoder's, the one placeholder cache layer an encoder gets handed to every layer (none reads it)."""
        return self.model(input_ids, positions, kv_caches[:1] * len(self.model.layers), attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Zeros: the token an embedding request samples is dropped."""
        return hidden.new_zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32)
