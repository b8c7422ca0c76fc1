"""The fused-MoE launcher's argument checks (`fused_moe.fused_moe`): a wrong dtype, shape or stride of a weight, its
scales or the routing gives silently wrong numbers in a Triton kernel, so each is checked first and a `ValueError`
names the argument. The K step of fp8 and int8 W8A8 experts (`fp8_k_step`) lives here, the checks' and the launcher's,
and int8 experts' widest K (`INT8_MAX_K`).
"""

from __future__ import annotations

import torch
import triton

from asyncllm.kernels._checks import check, check_float, check_last_dim_contiguous, check_same_device
from asyncllm.kernels.reference import MOE_ACTIVATIONS as ACTIVATIONS
from asyncllm.kernels.reference import Fp8Experts, IntExperts, Mxfp4Experts
from asyncllm.models.mxfp4 import MXFP4_GROUP

__all__ = ["FP8_K_STEP", "INT8_MAX_K", "check_args", "check_bias", "fp8_k_step"]

FP8_K_STEP = 128
"""The K step of fp8 experts whose scale group along K is wider than it: the block checkpoints' group, the step
they have always run with."""


INT8_MAX_K = (2**31 - 1) // (128 * 128)
"""131071: the widest K whose int8 products sum exactly in int32 (W8A8 int8 experts sum all of K before scaling):
each product is at most ``128 * 128`` in magnitude (-128 times -128: a token's or a weight's most negative value may
reach -128), so every partial sum stays within ``128 * 128 * K < 2**31``. Real experts' K is a few thousand."""


def fp8_k_step(group: int) -> int:
    """The K step (``BLOCK_K``) of fp8 experts whose scales group ``group`` columns along K: the group rounded up to a
    power of two (at least 16, `tl.dot`'s) up to `FP8_K_STEP`, else `FP8_K_STEP` (the group a multiple of it, or all
    of K). A group that is no power of two fits only when it covers all of K (`_check_fp8`): one masked step."""
    return min(max(16, triton.next_power_of_2(group)), FP8_K_STEP)


def check_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str, fp8: Fp8Experts | None,
                ints: IntExperts | None = None, mxfp4: Mxfp4Experts | None = None) -> tuple[int, int]:
    """(experts, intermediate size), or a `ValueError` naming the argument that does not fit."""
    check(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check(sum(q is not None for q in (fp8, ints, mxfp4)) <= 1, "fp8, int_experts or mxfp4: one at most")
    gated = activation != "relu2"
    check_float("hidden", hidden, 2)
    check_last_dim_contiguous("hidden", hidden)
    num_tokens, h = hidden.shape
    w8 = torch.int8 if w13.dtype == torch.int8 else torch.float8_e4m3fn  # fp8 or W8A8 int8 experts
    w_dtype = w8 if fp8 else torch.int32 if ints else torch.uint8 if mxfp4 else hidden.dtype
    pack = 32 // ints.bits if ints else 2 if mxfp4 else 1
    if ints is not None:
        check(ints.bits in (4, 8) and ints.group >= 1, f"int_experts: 4 or 8 bits and a group >= 1, got {ints.bits} "
                                                       f"bits and group {ints.group}")
        check(h % pack == 0, f"int_experts: hidden size {h} must be a multiple of the {pack} values per int32")
    check(mxfp4 is None or h % MXFP4_GROUP == 0, f"mxfp4: hidden's size H ({h}) must be a multiple of {MXFP4_GROUP}")
    h //= pack  # w13's packed columns
    check(w13.dim() == 3 and w13.dtype == w_dtype and w13.shape[2] == h
          and (w13.shape[1] % 2 == 0 or not gated) and w13.shape[0] >= 1,
          f"w13 must be [E, {'2I' if gated else 'I'}, {h}] of {w_dtype}, got {tuple(w13.shape)} of {w13.dtype}")
    check_last_dim_contiguous("w13", w13)
    num_experts, inter = w13.shape[0], w13.shape[1] // 2 if gated else w13.shape[1]
    h *= pack
    check(w2.dim() == 3 and w2.dtype == w_dtype and tuple(w2.shape) == (num_experts, h, inter // pack),
          f"w2 must be [{num_experts}, {h}, {inter // pack}] of {w_dtype}, got {tuple(w2.shape)} of {w2.dtype}")
    if ints is not None:
        _check_int(ints, num_experts, w13.shape[1], h, inter)
    if mxfp4 is not None:
        _check_mxfp4(mxfp4, w13, w2, inter)
    check_last_dim_contiguous("w2", w2)
    check(topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens and topk_ids.shape[1] >= 1,
          f"topk_ids must be [{num_tokens}, k], got shape {tuple(topk_ids.shape)}")
    check(topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}")
    check(tuple(topk_weights.shape) == tuple(topk_ids.shape),
          f"topk_weights must be {list(topk_ids.shape)} like topk_ids, got shape {tuple(topk_weights.shape)}")
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if fp8 is not None:
        _check_fp8(fp8, w13, w2)
    return num_experts, inter


def _check_int(ints: IntExperts, num_experts: int, rows13: int, h: int, inter: int) -> None:
    """Each matrix's scales and zero points ``[E, rows, ceil(K / group)]``; with its act-order ``g_idx`` (int32 ``[E,
    K]``, on the scales' device) ``[E, rows, groups]`` of any group count (a rank's down matrix: the whole one's)."""
    for name, t, rows, cols in (("w13", ints.w13_scales, rows13, h), ("w2", ints.w2_scales, h, inter)):
        g_idx = ints.w13_g_idx if name == "w13" else ints.w2_g_idx
        if g_idx is not None:
            check(g_idx.dtype == torch.int32 and tuple(g_idx.shape) == (num_experts, cols) and g_idx.stride(-1) == 1,
                  f"int_experts.{name}_g_idx must be int32 [{num_experts}, {cols}] (last dim contiguous), got "
                  f"{g_idx.dtype} {tuple(g_idx.shape)}")
            check_same_device(**{f"int_experts.{name}_g_idx": g_idx, f"int_experts.{name}_scales": t})
        groups = t.shape[-1] if g_idx is not None and t.dim() == 3 and t.shape[-1] >= 1 else -(-cols // ints.group)
        for kind, tensor in (("scales", t), ("zeros", ints.w13_zeros if name == "w13" else ints.w2_zeros)):
            shape = (num_experts, rows, groups)
            check(tuple(tensor.shape) == shape and tensor.stride(-1) == 1,
                  f"int_experts.{name}_{kind} must be {list(shape)} (last dim contiguous), got {tuple(tensor.shape)}")
        check(t.stride() == (ints.w13_zeros if name == "w13" else ints.w2_zeros).stride(),
              f"int_experts.{name} scales and zeros must share their strides")


def _check_mxfp4(mxfp4: Mxfp4Experts, w13: torch.Tensor, w2: torch.Tensor, inter: int) -> None:
    """I a multiple of 32 (H was checked) and each matrix's scales ``[E, rows, K / 32]`` uint8."""
    check(inter % MXFP4_GROUP == 0, f"mxfp4: w13's intermediate size I ({inter}) must be a multiple of {MXFP4_GROUP}")
    for name, scales, w in (("w13_scales", mxfp4.w13_scales, w13), ("w2_scales", mxfp4.w2_scales, w2)):
        shape = (w.shape[0], w.shape[1], w.shape[2] * 2 // MXFP4_GROUP)
        check(scales.dtype == torch.uint8 and tuple(scales.shape) == shape and scales.stride(-1) == 1,
              f"mxfp4.{name} must be uint8 {list(shape)} (last dim contiguous), got {scales.dtype} "
              f"{tuple(scales.shape)}")
        check_same_device(**{f"mxfp4.{name}": scales, "w13": w13})


def _check_fp8(fp8: Fp8Experts, w13: torch.Tensor, w2: torch.Tensor) -> None:
    (bn, bk), step, widest = fp8.block, fp8_k_step(fp8.block[1]), max(w13.shape[2], w2.shape[2])
    check(bn >= 1 and step >= 16 and step & (step - 1) == 0 and (bk % step == 0 or bk >= widest),
          f"fp8 experts need a block of 16, 32, 64 or 128 columns, a multiple of {FP8_K_STEP}, or one covering all "
          f"of K (at least {widest}); got {fp8.block}")
    check(w13.dtype != torch.int8 or bk >= widest, f"int8 experts quantize each token's input whole: their block "
                                                   f"must cover all of K (at least {widest}); got {fp8.block}")
    check(w13.dtype != torch.int8 or widest <= INT8_MAX_K, f"int8 experts sum each product in int32: K (here "
                                                           f"{widest}) must be at most {INT8_MAX_K}")
    for name, scale in (("w13_input_scale", fp8.w13_input_scale), ("w2_input_scale", fp8.w2_input_scale)):
        check(scale is None or (scale.dtype == torch.float32 and scale.numel() == 1 and w13.dtype != torch.int8
                                and bk >= widest),
              f"{name} (a static activation scale) must be one float32 value, on fp8 experts whose block covers all "
              f"of K (at least {widest}); got {None if scale is None else (scale.dtype, tuple(scale.shape))}, "
              f"block {fp8.block}")
        if scale is not None:
            check_same_device(**{name: scale, "w13": w13})
    for name, scale, w in (("w13_scale", fp8.w13_scale, w13), ("w2_scale", fp8.w2_scale, w2)):
        shape = (w.shape[0], triton.cdiv(w.shape[1], bn), triton.cdiv(w.shape[2], bk))
        check(scale.dtype == torch.float32 and tuple(scale.shape) == shape and scale.stride(2) == 1,
              f"{name} must be float32 {list(shape)} with contiguous rows, got {scale.dtype} {tuple(scale.shape)}")
        check_same_device(**{name: scale, "w": w})


def check_bias(name: str, bias: torch.Tensor | None, hidden: torch.Tensor, shape: tuple[int, int]) -> None:
    if bias is None:
        return
    check(tuple(bias.shape) == shape and bias.dtype == hidden.dtype and bias.stride(1) == 1,
          f"{name} must be {list(shape)} of {hidden.dtype}, contiguous rows; got {tuple(bias.shape)} of {bias.dtype}")
    check_same_device(hidden=hidden, **{name: bias})
