"""The triton attention backend: the GPU default, built on the Triton kernels of `asyncllm.kernels`.

Per layer, two launches: `rotary_embedding_with_kv_cache` rotates q and k (after
Qwen3's per-head q/k RMSNorm, fused in) and stores k and v at the step's slots
(a layer without rotary, ALiBi's, or with a one-part latent cache: `write_kv_cache`,
which skips padding on the device, so no layer's write syncs with the host),
then the unified varlen `paged_attention` kernel serves prefill chunks (with
cached context) and decodes in one grid.
A decode-only step too small to fill the GPU runs the split-KV `paged_decode`
kernels instead (`split_kv_segments` decides).
The model's norms, SiLU-and-mul and mixture-of-experts MLPs run the Triton kernels too (`ops`).

Importing this module imports triton: only `asyncllm.attention.selector`
does, and only when the backend is chosen. On a CPU the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1``, for tests; slow).
"""

from __future__ import annotations

import functools

import torch
import triton

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.kernels import reference
from asyncllm.kernels.fused_moe import fused_moe
from asyncllm.kernels.gated_delta import gated_delta_step
from asyncllm.kernels.kv_write import write_kv_cache
from asyncllm.kernels.paged_attention import paged_attention
from asyncllm.kernels.paged_decode import paged_decode
from asyncllm.kernels.rms_norm import fused_add_rms_norm, gemma_fused_add_rms_norm, gemma_rms_norm, rms_norm
from asyncllm.kernels.rotary_kv import rotary_embedding_with_kv_cache
from asyncllm.kernels.silu_and_mul import gelu_tanh_and_mul, silu_and_mul
from asyncllm.kernels.ssd_step import ssd_decode_step
from asyncllm.models.ops import ModelOps

__all__ = ["TritonBackend", "TRITON_OPS", "split_kv_segments"]

_MAX_SEGMENTS = 16  # split-KV segments per request: more adds combine work for little extra parallelism

TRITON_OPS = ModelOps("triton", rms_norm, fused_add_rms_norm, silu_and_mul, fused_moe, gemma_rms_norm=gemma_rms_norm,
                      gemma_fused_add_rms_norm=gemma_fused_add_rms_norm, gelu_tanh_and_mul=gelu_tanh_and_mul,
                      gated_delta_step=gated_delta_step, ssd_decode_step=ssd_decode_step)
"""The model's non-attention ops as Triton kernels."""


class TritonBackend:
    """Paged attention with the Triton kernels; stateless, one instance serves every layer."""

    name = "triton"
    ops: ModelOps = TRITON_OPS

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
        caps the scores (Gemma 2), ``sinks [Hq]`` joins each softmax (gpt-oss) and ``attention_chunk_size``
        keeps each query to the keys of its own chunk (Llama 4) and ``alibi_slopes [Hq]`` biases each score by
        ``slope_h * (key_pos - query_pos)`` (BLOOM, MPT) in either kernel; ``metadata.attend_limit``
        (Gemma 3's image tokens) always takes the unified kernel. ``key`` and ``value`` None: attend over the
        cache as it is, writing nothing (Gemma 4's KV-sharing layers); ``value`` alone None: a one-part cache
        ``[1, ...]`` whose keys are the values (latent attention: the output is as wide as the keys).
        """
        key_cache, value_cache = kv_cache[0], kv_cache[-1]  # a one-part cache's keys are its values
        if key is None:  # a KV-sharing layer (Gemma 4): reads the cache another layer wrote this step
            assert rotary is None and value is None, "a KV-sharing layer hands over its query rotated, no K/V"
        elif rotary is None or value is None:
            if rotary is not None:
                query, key = reference.norm_and_rotate(query, key, rotary)
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping)  # ALiBi, latent attention: no host sync
        else:
            query = rotary_embedding_with_kv_cache(
                query, key, value, rotary.positions, rotary.cos_sin_cache, key_cache, value_cache,
                metadata.slot_mapping, rotary.q_norm_weight, rotary.k_norm_weight, rotary.norm_eps,
            )
        num_segments = 0
        if metadata.attend_limit is None:  # the split-KV kernels are causal only (image tokens come in prefills)
            num_segments = split_kv_segments(query.shape[0], metadata.num_reqs, key_cache.shape[2],
                                             _num_sms(query.device))
        if num_segments:
            return paged_decode(
                query, key_cache, value_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                scale, num_segments, sliding_window, softcap=softcap, sinks=sinks,
                attention_chunk_size=attention_chunk_size, alibi_slopes=alibi_slopes,
            )
        return paged_attention(
            query, key_cache, value_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
            scale, sliding_window, softcap=softcap, sinks=sinks, attend_limit=metadata.attend_limit,
            attention_chunk_size=attention_chunk_size, alibi_slopes=alibi_slopes,
        )


def split_kv_segments(num_tokens: int, num_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Segments per request for the split-KV decode kernels, or 0 for the unified kernel.

    The unified kernel runs ``num_reqs * num_kv_heads`` programs on a decode step; when that
    leaves SMs idle, a decode-only step (one token per request: host-known, and static under a
    CUDA graph) splits each context so that about two programs run per SM, at most 16 segments
    (a power of two). Only static values decide, so a captured graph keeps its choice.
    """
    programs = num_reqs * num_kv_heads
    if num_tokens != num_reqs or programs >= num_sms:
        return 0
    return min(_MAX_SEGMENTS, triton.next_power_of_2(-(-2 * num_sms // programs)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    """The GPU's SM count; an H100's (132) for Triton's CPU interpreter."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
