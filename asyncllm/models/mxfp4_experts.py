"""gpt-oss's MXFP4 experts kept packed: the fused-MoE kernel's MXFP4 path reads them as the checkpoint stores them.

On the Triton backend a `GptOssExperts` of an MXFP4 checkpoint holds, for its local experts,

- ``w13_weight`` uint8 ``[E, 2I, H / 2]``: each gate row, then each up row (the checkpoint interleaves them: rows
  ``0::2`` gate, ``1::2`` up), its e2m1 values two per byte along the input, the low nibble first: the checkpoint's
  ``gate_up_proj_blocks [E, 2I, H / 32, 16]`` with its last two dims merged;
- ``w2_weight`` uint8 ``[E, H, I / 2]`` from ``down_proj_blocks [E, H, I / 32, 16]``;
- ``w13_scales`` ``[E, 2I, H / 32]`` and ``w2_scales`` ``[E, H, I / 32]``: uint8 e8m0 exponents, one per 32 inputs;

about 4.25 bits a weight instead of 16 (gpt-oss-120b's experts: 61 GB instead of 229 GB), and
`reference.Mxfp4Experts` hands the scales to ``fused_moe``. Under tensor parallelism each rank keeps its rows of
gate and up and its columns of down (``I / N`` of them: whole groups of 32, else the experts are dequantized as
below), or whole experts with expert parallelism. The kernel dequantizes each tile exactly as
`mxfp4.dequantize_mxfp4` does at load, so the packed experts compute what the dequantized ones compute.

Elsewhere (the torch_sdpa backend, the CPU's default: `reference.fused_moe` would dequantize every expert at
every step) and where a rank's split cuts a group, the experts are dequantized at load (asyncllm/models/gpt_oss.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from asyncllm.models.checkpoint import checkpoint_quantization
from asyncllm.models.layers import LoadedWeight, copy_weight, new_param, weight_narrow, weight_shape
from asyncllm.models.mxfp4 import MXFP4_GROUP

if TYPE_CHECKING:
    from asyncllm.models.gpt_oss import GptOssExperts

__all__ = ["packed_off_reason", "serves_packed", "make_packed_params", "load_packed", "draw_packed", "DUMMY_SCALE"]

DUMMY_SCALE = 120
"""Dummy weights' exponent: ``2 ** -7`` times random e2m1 values (RMS 2.9) is an RMS of about 0.023, near the float
dummy weights' 0.02 (`loader.init_dummy_weights`)."""


def packed_off_reason(backend: str | None, hidden: int, intermediate: int) -> str | None:
    """Why this rank's MXFP4 experts (``intermediate`` rows of each) are dequantized at load on the ``backend``
    attention backend rather than kept packed, or None."""
    if backend != "triton":
        return f"the {backend} backend runs experts with the torch reference, which reads float weights"
    if hidden % MXFP4_GROUP or intermediate % MXFP4_GROUP:
        return (f"this rank's experts ({intermediate} intermediate rows, hidden size {hidden}) are not whole groups "
                f"of {MXFP4_GROUP} values")
    return None


def serves_packed(hf_config: Any, backend: str | None, tp_size: int, expert_parallel: bool) -> bool:
    """Whether a gpt-oss MXFP4 checkpoint's experts are served packed on ``backend`` over ``tp_size`` ranks (what
    the bench's roofline counts); `packed_off_reason` decides it for each rank's experts as it builds them."""
    if checkpoint_quantization(hf_config) != "mxfp4":
        return False
    inter = hf_config.intermediate_size // (1 if expert_parallel or tp_size <= 1 else tp_size)
    return packed_off_reason(backend, hf_config.hidden_size, inter) is None


def make_packed_params(moe: GptOssExperts) -> None:
    """``moe``'s packed weights and scales (its float ``w13_weight`` / ``w2_weight`` are never built:
    `GptOssExperts.make_weights`)."""
    n, inter, hidden = moe.num_local_experts, moe.intermediate, moe.hidden_size
    for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        setattr(moe, f"{name}_weight", new_param(n, rows, cols // 2, dtype=torch.uint8, loader=moe.stacked_loader))
        setattr(moe, f"{name}_scales", new_param(n, rows, cols // MXFP4_GROUP, dtype=torch.uint8,
                                                 loader=moe.stacked_loader))


def load_packed(moe: GptOssExperts, dst: torch.Tensor, loaded: LoadedWeight, shard_id: str) -> None:
    """A stacked ``*_blocks`` / ``*_scales`` tensor into ``dst`` (its packed parameter): this rank's experts, their
    rows of gate and up (de-interleaved) or their columns of down, as they are stored."""
    proj, kind = shard_id.rsplit("_", 1)
    whole = moe.whole_intermediate  # every rank checks the whole tensor
    rows, inputs = (moe.hidden_size, whole) if proj == "down" else (2 * whole, moe.hidden_size)
    groups = inputs // MXFP4_GROUP
    expected = (moe.num_experts, rows, groups, MXFP4_GROUP // 2) if kind == "blocks" else (moe.num_experts, rows, groups)
    if weight_shape(loaded) != expected:
        raise ValueError(f"has shape {weight_shape(loaded)}, this model's MXFP4 {proj} {kind} are {expected}")
    start = moe.intermediate_start
    unit = 2 if kind == "blocks" else MXFP4_GROUP  # inputs per byte of blocks or per exponent
    for expert in moe.local_experts:
        stored = weight_narrow(loaded, 0, expert, 1)[0].reshape(rows, -1)  # blocks: [rows, inputs / 2] bytes
        out = dst[expert - moe.expert_start]
        if proj == "down":
            copy_weight(out, stored.narrow(1, start // unit, moe.intermediate // unit))
            continue
        for offset, part in ((0, stored[0::2]), (moe.intermediate, stored[1::2])):  # gate rows, then up rows
            copy_weight(out.narrow(0, offset, moe.intermediate), part.narrow(0, start, moe.intermediate))


def draw_packed(moe: GptOssExperts, generator: torch.Generator) -> None:
    """Dummy weights: random bytes (every e2m1 value) at the `DUMMY_SCALE` exponent."""
    for name in ("w13", "w2"):
        blocks: nn.Parameter = getattr(moe, f"{name}_weight")
        blocks.data.copy_(torch.randint(0, 256, blocks.shape, generator=generator, dtype=torch.uint8,
                                        device=generator.device))
        getattr(moe, f"{name}_scales").data.fill_(DUMMY_SCALE)
