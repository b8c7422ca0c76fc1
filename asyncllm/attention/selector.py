"""Pick the attention backend a model's layers run with."""

from __future__ import annotations

from typing import Protocol

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.torch_sdpa import TorchSDPABackend
from asyncllm.errors import NotBuiltError

__all__ = ["AttentionBackend", "get_attention_backend"]


class AttentionBackend(Protocol):
    """What an attention layer asks of its backend (one instance shared by all layers)."""

    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write key/value ``[T, Hkv, D]`` at the step's slots; attend query ``[T, Hq, D]``."""
        ...


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The backend called ``name``; None picks the default (torch_sdpa for now, on every device).

    `EngineConfig` already refuses unbuilt backends; this re-checks for direct callers.
    """
    del device  # torch_sdpa runs everywhere; the GPU default (triton, not built yet) will depend on it
    if name is None or name == "torch_sdpa":
        return TorchSDPABackend()
    raise NotBuiltError("attention_backend", name, f"the {name} attention backend")
