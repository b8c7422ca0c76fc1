"""The non-attention ops a model's layers call, as one swappable set.

The attention backend carries the set its layers should use (`AttentionBackend.ops`):
torch_sdpa carries `REFERENCE_OPS` (torch, every device, the reference), the
triton backend carries the Triton kernels of `asyncllm.kernels`. So choosing a
backend in `asyncllm.attention.selector` chooses every kernel of the model in
one place, and the torch path stays the exact reference end to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from asyncllm.kernels import reference

__all__ = ["ModelOps", "REFERENCE_OPS"]


@dataclass(frozen=True)
class ModelOps:
    """RMSNorm (plain and fused with the residual add), SiLU-and-mul and the mixture-of-experts MLP
    (``fused_moe(hidden, w13, w2, topk_weights, topk_ids)``), same signatures as `reference`; Gemma's
    RMSNorm pair (weight as an offset from 1, rounded once) and its GeGLU (``gelu_tanh_and_mul``)."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    fused_moe: Callable[..., torch.Tensor]
    """``(hidden, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, swiglu=None)``: the biases and
    the clamped SwiGLU are gpt-oss's."""
    gemma_rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    gemma_fused_add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor]
    gated_delta_step: Callable[..., torch.Tensor] = reference.gated_delta_step
    """``(states, rows, q, k, v, g, beta)``: the Gated DeltaNet's decode step on the requests' state rows."""
    ssd_decode_step: Callable[..., torch.Tensor] = reference.ssd_decode_step
    """``(states, rows, x, b, c, dt, a)``: Mamba2's decode step on the requests' state rows."""


REFERENCE_OPS = ModelOps(
    "reference", reference.rms_norm, reference.fused_add_rms_norm, reference.silu_and_mul, reference.fused_moe,
    gemma_rms_norm=reference.gemma_rms_norm, gemma_fused_add_rms_norm=reference.gemma_fused_add_rms_norm,
    gelu_tanh_and_mul=reference.gelu_tanh_and_mul,
)
"""The torch reference ops."""
