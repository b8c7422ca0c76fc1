"""Batch-level data parallelism for the vision encoder (``mm_encoder_tp_mode="data"``).

The encoder's weights are replicated on every tensor-parallel rank (the model is
built with ``mm_encoder_tp_mode="data"``, so its tower is not sharded). The images a
step must encode (the same list, in the same order, on every rank: the ranks run
the same steps over identical encoder caches) are dealt round-robin: rank r encodes
images r, r + size, ... The ranks first sum their images' row counts (each its
own share's: an image's data decides them), then each rank's features, flattened
to ``[rows, hidden]`` and padded to the largest share, are all-gathered as raw
bytes (any dtype, gloo or NCCL), and every rank unpacks the full list. A rank whose share is empty (fewer
images than ranks) still takes part in the gather with padding only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asyncllm.mm.embeddings import encode_items
from asyncllm.models.layers import TensorParallel
from asyncllm.protocol import MultiModalItem

__all__ = ["DataParallelEncoder"]


class DataParallelEncoder:
    """An `EncodeFn` that splits the images across the TP ranks and gathers the features on all of them."""

    def __init__(self, model: Any, device: torch.device, tp: TensorParallel) -> None:
        # a sharded encoder would run collectives inside each rank's share: built for "data", it is whole
        assert getattr(model, "encoder_tp", TensorParallel()).size == 1, "the encoder must be built whole on every rank"
        self.model = model
        self.device = device
        self.tp = tp

    def shares(self, items: list[MultiModalItem]) -> list[list[MultiModalItem]]:
        """Rank r's images, for every r."""
        return [items[rank :: self.tp.size] for rank in range(self.tp.size)]

    def __call__(self, items: list[MultiModalItem], hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
        shares = self.shares(items)
        mine = shares[self.tp.rank]
        features = encode_items(self.model, mine, self.device) if mine else []
        rows = self._gather_rows(len(items), [f.shape[0] for f in features])
        rows_per_rank = [sum(rows[rank :: self.tp.size]) for rank in range(self.tp.size)]
        padded = torch.zeros(max(rows_per_rank), hidden, dtype=dtype, device=self.device)
        encoded = [f for f in features if len(f)]  # an item the encoder refused has none (and no device)
        if encoded:
            padded[: rows_per_rank[self.tp.rank]] = torch.cat(encoded).to(dtype)
        gathered = self._all_gather_bytes(padded)
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for rank, (share, flat) in enumerate(zip(shares, gathered)):
            start = 0
            for k in range(len(share)):
                index = rank + k * self.tp.size
                out[index] = flat[start : start + rows[index]]
                start += rows[index]
        return out

    def _gather_rows(self, num_items: int, mine: list[int]) -> list[int]:
        """Every item's encoder rows, as the rank that encoded it counted them (its data's, which may disagree with
        its placeholders: `EncoderOutputCache` fails such a request on every rank alike)."""
        rows = torch.zeros(num_items, dtype=torch.int64, device=self.device)
        rows[self.tp.rank :: self.tp.size] = torch.tensor(mine, dtype=torch.int64)
        dist.all_reduce(rows, group=self.tp.group)
        return rows.tolist()

    def _all_gather_bytes(self, padded: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``padded`` (same shape and dtype on all), rank order; gathered as uint8."""
        raw = padded.view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(self.tp.size)]
        dist.all_gather(parts, raw, group=self.tp.group)  # a pipeline's first stage: its own TP ranks
        return [part.view(padded.dtype) for part in parts]
