"""MXFP4 checkpoints (gpt-oss's experts): the format, and its dequantization to the model's dtype.

A weight ``W [..., R, C]`` is stored as two uint8 tensors, in groups of 32 along its last dim:

- ``<name>_blocks [..., R, C / 32, 16]``: two e2m1 (FP4) values per byte, the low nibble first;
- ``<name>_scales [..., R, C / 32]``: each group's e8m0 exponent, biased by 127.

A value is ``FP4_VALUES[nibble] * 2 ** (scale - 127)``, transformers' ``convert_moe_packed_tensors``
(transformers/integrations/mxfp4.py) to the bit: the same table, nibble order and ``ldexp`` in the
model's dtype (every FP4 value times a power of two is exact in float32 and bfloat16 while the
exponent stays in their range). transformers then transposes to its ``[E, in, out]`` parameters;
asyncllm keeps the stored ``[E, out, in]`` rows, its experts' layout.

On the Triton backend the experts stay packed (asyncllm/models/mxfp4_experts.py: the fused-MoE kernel decodes
each tile to exactly these values); elsewhere they are dequantized at load with `dequantize_mxfp4`, 3.8x the
memory of the blocks and scales in bfloat16 (docs/gpt-oss.md).
"""

from __future__ import annotations

import torch

__all__ = ["FP4_VALUES", "MXFP4_GROUP", "dequantize_mxfp4"]

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each nibble (sign bit high), as transformers' ``FP4_VALUES``."""
MXFP4_GROUP = 32
"""Values sharing one exponent (16 bytes of blocks)."""
_SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` (uint8) -> ``[..., G * 32]`` in ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"has MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}, not [..., G, 16] "
                         "and [..., G]")
    blocks = blocks.to(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(*blocks.shape[:-1], MXFP4_GROUP, dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, scales.to(torch.int32).unsqueeze(-1) - _SCALE_BIAS, out=out)  # in dtype, as transformers
    return out.reshape(*blocks.shape[:-2], -1)
