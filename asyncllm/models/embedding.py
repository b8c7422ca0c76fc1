"""Vocabulary-parallel token embedding and LM head.

The vocabulary is cut into ``tp`` equal ranges (the last one padded with zero
rows); rank r owns rows ``[r * V_rank, (r + 1) * V_rank)``. The embedding looks
up the ids it owns, zeroes the others and all_reduces; the LM head computes its
slice of the logits and all_gathers them, dropping the padding, so every rank
ends with the full vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models.layers import LoadedWeight, TensorParallel, copy_weight, new_param, weight_narrow, weight_shape

__all__ = ["VocabParallelEmbedding", "ParallelLMHead"]


class VocabParallelEmbedding(nn.Module):
    """``[T] ids -> [T, hidden]`` with this rank's slice of the embedding matrix."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel,
        dtype: torch.dtype,
        shared_weight: nn.Parameter | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_size_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_size_per_rank
        if shared_weight is None:
            shared_weight = new_param(self.vocab_size_per_rank, hidden_size, dtype=dtype, loader=self.weight_loader)
        self.weight = shared_weight

    @property
    def num_real_rows(self) -> int:
        """Rows of this rank's slice that hold real tokens (the rest is padding)."""
        return max(0, min(self.vocab_size - self.vocab_start, self.vocab_size_per_rank))

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        rows = weight_shape(loaded)[0]
        if rows != self.vocab_size:
            raise ValueError(f"has {rows} rows, the model's vocab_size is {self.vocab_size}")
        with torch.no_grad():
            param.data[self.num_real_rows :].zero_()
        src = weight_narrow(loaded, 0, self.vocab_start, self.num_real_rows)
        copy_weight(param.data[: self.num_real_rows], src)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        owned = (local_ids >= 0) & (local_ids < self.vocab_size_per_rank)
        out = F.embedding(local_ids.masked_fill(~owned, 0), self.weight)
        out.masked_fill_(~owned.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """``[N, hidden] -> [N, vocab_size]`` logits; shares the embedding's weight when tied."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel,
        dtype: torch.dtype,
        tied_to: VocabParallelEmbedding | None = None,
        bias: bool = False,
    ):
        """``bias``: a bias per token (Phi's, GPT-J's), this rank's slice of it."""
        super().__init__(vocab_size, hidden_size, tp, dtype, None if tied_to is None else tied_to.weight)
        self.bias = new_param(self.vocab_size_per_rank, dtype=dtype, loader=self.weight_loader) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(F.linear(hidden, self.weight, self.bias))
        return logits[..., : self.vocab_size]
