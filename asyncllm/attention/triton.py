"""The triton attention backend: the GPU default, built on the Triton kernels of `asyncllm.kernels`.

Per layer, two launches: `rotary_embedding_with_kv_cache` rotates q and k and
stores k and v at the step's slots, then the unified varlen `paged_attention`
kernel serves prefill chunks (with cached context) and decodes in one grid.
The model's norms and SiLU-and-mul run the Triton kernels too (`ops`).

Importing this module imports triton: only `asyncllm.attention.selector`
does, and only when the backend is chosen. On a CPU the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1``, for tests; slow).
"""

from __future__ import annotations

import torch

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.kernels import reference
from asyncllm.kernels.paged_attention import paged_attention
from asyncllm.kernels.rms_norm import fused_add_rms_norm, rms_norm
from asyncllm.kernels.rotary_kv import rotary_embedding_with_kv_cache
from asyncllm.kernels.silu_and_mul import silu_and_mul
from asyncllm.models.ops import ModelOps

__all__ = ["TritonBackend", "TRITON_OPS"]

TRITON_OPS = ModelOps("triton", rms_norm, fused_add_rms_norm, silu_and_mul)
"""The model's non-attention ops as Triton kernels."""


class TritonBackend:
    """Paged attention with the Triton kernels; stateless, one instance serves every layer."""

    name = "triton"
    ops: ModelOps = TRITON_OPS

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        rotary: RotaryInputs | None = None,
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``, key/value ``[T, Hkv, D]`` -> attention output ``[T, Hq, D]``.

        ``kv_cache`` is ``[2, num_blocks, block_size, Hkv, D]``; it is updated in place.
        """
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if rotary is None:
            reference.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        else:
            query = rotary_embedding_with_kv_cache(
                query, key, value, rotary.positions, rotary.cos_sin_cache, key_cache, value_cache,
                metadata.slot_mapping,
            )
        return paged_attention(
            query, key_cache, value_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
            scale, sliding_window,
        )
