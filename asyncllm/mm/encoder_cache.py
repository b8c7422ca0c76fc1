"""Worker side: encoder outputs kept across requests, by item hash, under a byte budget.

An entry is **pinned** while some request's prefill still needs rows of it (its
placeholder range is reached but not yet passed): pinned entries are never evicted,
even past the budget, so eviction cannot break a prefill in flight. Unpinned
entries stay in least-recently-used order and are evicted, oldest first, while the
cache holds more than ``budget_bytes``; a later request with the same image then
finds it (`acquire`) instead of running the encoder again.

Every tensor-parallel rank applies the same operations in the same order, so every
rank holds the same entries (the data-parallel encoder relies on it: all ranks must
agree on which images to encode).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["EncoderCache"]


@dataclass
class _Pinned:
    features: torch.Tensor
    count: int


def _nbytes(features: torch.Tensor) -> int:
    return features.numel() * features.element_size()


class EncoderCache:
    """mm_hash -> ``[placeholder length, hidden]`` features; pinned ones kept, the rest an LRU under a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.total_bytes = 0
        """Bytes of every entry held, pinned or not."""
        self._pinned: dict[str, _Pinned] = {}
        self._unpinned: OrderedDict[str, torch.Tensor] = OrderedDict()
        """Oldest first."""

    def __len__(self) -> int:
        return len(self._pinned) + len(self._unpinned)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._pinned or mm_hash in self._unpinned

    def acquire(self, mm_hash: str) -> torch.Tensor | None:
        """The features of ``mm_hash``, pinned once more; None when not cached."""
        entry = self._pinned.get(mm_hash)
        if entry is not None:
            entry.count += 1
            return entry.features
        features = self._unpinned.pop(mm_hash, None)
        if features is not None:
            self._pinned[mm_hash] = _Pinned(features, 1)
        return features

    def insert(self, mm_hash: str, features: torch.Tensor) -> None:
        """Add freshly encoded features, pinned once (the caller is about to use them)."""
        assert mm_hash not in self, f"{mm_hash} is already cached: acquire it instead"
        self._pinned[mm_hash] = _Pinned(features, 1)
        self.total_bytes += _nbytes(features)
        self._evict()

    def get_pinned(self, mm_hash: str) -> torch.Tensor:
        """The features of a hash the caller holds a pin on."""
        return self._pinned[mm_hash].features

    def release(self, mm_hash: str) -> None:
        """Drop one pin; the last one makes the entry evictable (newest in LRU order)."""
        entry = self._pinned[mm_hash]
        entry.count -= 1
        if entry.count == 0:
            del self._pinned[mm_hash]
            if not entry.features.numel():  # an output the encoder refused (asyncllm/mm/embeddings.py): never kept
                return
            self._unpinned[mm_hash] = entry.features
            self._evict()

    def _evict(self) -> None:
        while self.total_bytes > self.budget_bytes and self._unpinned:
            _, features = self._unpinned.popitem(last=False)
            self.total_bytes -= _nbytes(features)
