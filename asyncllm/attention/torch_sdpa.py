"""The torch_sdpa attention backend: the CPU default and the reference for the others.

It rotates q and k when the layer hands it the rotary inputs (after their
per-head RMSNorm, for Qwen3: `asyncllm.kernels.reference.norm_and_rotate`),
writes the step's K/V into the paged cache, then runs one ``scaled_dot_product_attention``
per request over that request's whole context gathered from its block table
(see `asyncllm.kernels.reference.paged_attention`). Simple and exact rather
than fast: the GPU path has its own kernels.
"""

from __future__ import annotations

import torch

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.kernels import reference
from asyncllm.models.ops import REFERENCE_OPS, ModelOps

__all__ = ["TorchSDPABackend"]


class TorchSDPABackend:
    """Paged attention with torch only; holds no state, so one instance serves every layer."""

    name = "torch_sdpa"
    ops: ModelOps = REFERENCE_OPS

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        rotary: RotaryInputs | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk_size: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` -> attention output ``[T, Hq, D]``.

        ``kv_cache`` is ``[2, num_blocks, block_size, Hkv, D]`` (or ``[1, ...]``); it is updated in place. ``softcap``
        caps the scores (Gemma 2: `reference.paged_attention`); ``sinks [Hq]`` joins each softmax (gpt-oss);
        ``attention_chunk_size`` keeps each query to the keys of its own chunk (Llama 4's chunked local layers);
        ``alibi_slopes [Hq]`` biases each score by ``slope_h * (key_pos - query_pos)`` (BLOOM, MPT).
        ``key`` and ``value`` None: attend over the cache as it is, writing nothing (Gemma 4's KV-sharing layers);
        ``value`` alone None: a one-part cache ``[1, ...]`` whose keys are the values (latent attention: the output
        is as wide as the keys).
        """
        if key is None:  # a KV-sharing layer (Gemma 4): reads the cache another layer wrote this step
            assert rotary is None and value is None, "a KV-sharing layer hands over its query rotated, no K/V"
        else:  # value None: a one-part cache, whose keys are the values (latent attention)
            if rotary is not None:
                query, key = reference.norm_and_rotate(query, key, rotary)
            reference.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return reference.paged_attention(query, kv_cache, metadata, scale, sliding_window, softcap, sinks,
                                         attention_chunk_size=attention_chunk_size, alibi_slopes=alibi_slopes)
