"""ColBERT late-interaction encoders: ``HF_ColBERT`` checkpoints (colbert-ir/colbertv2.0, answerai-colbert-small).

A ColBERT checkpoint is a BERT encoder (asyncllm/models/bert.py) and a bias-free linear projection ``linear.weight``
``[dim, hidden]`` that every token's final hidden state goes through: the model's output rows are those projected
rows (``dim`` wide), which the worker's per-token pooling (``token_embed``, vLLM's ALL) L2-normalizes one by one
unless a request asks ``normalize=False``. It serves ``token_embed`` only, as vLLM's ``ColBERTModel``; a score of two
texts is the MaxSim of their token embeddings (asyncllm/engine/scoring.py, docs/pooling.md).

The width comes from config ``colbert_dim``, ``dim`` or ``projection_dim`` (`late_interaction_dim`; a `ConfigError`
naming them when none is set, checked on the host before anything is spawned). The projection reads
``linear.weight`` or ``colbert_linear.weight`` (either under the encoder's ``bert.`` / ``model.`` prefix or bare); it
is small, so every tensor-parallel rank keeps all of it, in the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.architectures import late_interaction_dim
from asyncllm.models.bert import BertEmbeddingModel

__all__ = ["ColBERTModel"]

_PROJECTION = "linear.weight"
_PROJECTION_NAMES = ("linear.weight", "colbert_linear.weight")
"""The checkpoint names of the projection (colbert-ir's, and vLLM's other spelling)."""


class ColBERTModel(BertEmbeddingModel):
    """A BERT encoder whose output rows are its final hidden states projected to the ColBERT dimension."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.linear = nn.Linear(hf_config.hidden_size, self.embedding_width(hf_config), bias=False,
                                dtype=kwargs["dtype"])

    @staticmethod
    def embedding_width(hf_config: Any) -> int:
        """The rows' width (the host's embedding width): the checkpoint's ColBERT dimension."""
        return late_interaction_dim(hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, token_type_starts: list[int | None] | None = None) -> torch.Tensor:
        """``[T]`` ids of whole prompts -> ``[T, dim]``: each token's final hidden state through the projection."""
        return self.linear(super().forward(input_ids, positions, kv_caches, attn_metadata, token_type_starts))

    # ---- weights: BERT's names, and the projection under either name
    def _canonical(self, raw_name: str) -> str | None:
        name = super()._canonical(raw_name)
        return _PROJECTION if name in _PROJECTION_NAMES else name

    def _target(self, name: str) -> tuple[str, object]:
        return (name, None) if name == _PROJECTION else super()._target(name)

    def _checkpoint_names(self, param_name: str) -> list[str]:
        return [param_name] if param_name == _PROJECTION else super()._checkpoint_names(param_name)
