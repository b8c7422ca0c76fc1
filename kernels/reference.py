"""Torch reference implementations of the ops the models run.

The models call these on every device where no faster kernel exists, and each
Triton kernel in this package is tested against the function of the same name
here. They follow Hugging Face transformers' order of operations (RMSNorm in
float32 then cast, rotary cos/sin computed in float32 and cast to the
activation dtype) so that float32 outputs match transformers' to rounding.
No policy lives here: shapes in, tensors out.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from asyncllm.attention.metadata import RotaryInputs
# compressed-tensors' W8A8 int8 math, defined once in models.int8: `quantize_int8_per_token` is the reference of
# the Triton `int8_quant.quantize_int8_per_token` (W8A8 int8 experts' inputs)
from asyncllm.models.int8 import INT8_MAX, INT8_MIN, int8_linear_fallback, quantize_int8_per_token
from asyncllm.models.mxfp4 import MXFP4_GROUP, dequantize_mxfp4
# the quantized products' references (block fp8, static fp8, integer weight-only), re-exported as this module's own
from asyncllm.kernels.reference_quant import (
    FP8_E4M3_MAX, FP8_MIN_SCALE, dequantize_fp8_blocks, dequantize_int_weight, expand_block_scales,
    per_token_group_quant_fp8, static_quant_fp8, unpack_int_rows, w4a16_matmul, w8a8_block_fp8_matmul,
)
# rotary, the KV cache and paged attention, re-exported as this module's own
from asyncllm.kernels.reference_attention import (
    alibi_bias, apply_rotary, build_cos_sin_cache, gather_kv, paged_attention, rotate_half, to_kv_cache_dtype,
    write_kv_cache,
)

__all__ = [
    "rms_norm",
    "fused_add_rms_norm",
    "gemma_rms_norm",
    "gemma_fused_add_rms_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "decode_linear",
    "ClampedSwiglu",
    "Fp8Experts",
    "IntExperts",
    "Mxfp4Experts",
    "dequantize_int_expert",
    "gated_delta_step",
    "ssd_decode_step",
    "clamped_swiglu",
    "fused_moe",
    "MOE_ACTIVATIONS",
    "rotate_half",
    "build_cos_sin_cache",
    "apply_rotary",
    "norm_and_rotate",
    "to_kv_cache_dtype",
    "write_kv_cache",
    "gather_kv",
    "alibi_bias",
    "paged_attention",
    "FP8_E4M3_MAX",
    "FP8_MIN_SCALE",
    "expand_block_scales",
    "per_token_group_quant_fp8",
    "static_quant_fp8",
    "INT8_MIN",
    "INT8_MAX",
    "quantize_int8_per_token",
    "dequantize_fp8_blocks",
    "w8a8_block_fp8_matmul",
    "unpack_int_rows",
    "dequantize_int_weight",
    "w4a16_matmul",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: statistics in float32, the scale in x's dtype (as HF does)."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (in x's dtype), then ``rms_norm(new_residual)``.

    Returns ``(normed, new_residual)``; the same rounding as HF's separate add and norm.
    """
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the whole norm runs in float32,
    rounded to x's dtype once at the end (``(x32 * rsqrt(mean(x32^2) + eps) * (1 + w32)).to(x.dtype)``)."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.to(torch.float32))).to(x.dtype)


def gemma_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm` with `gemma_rms_norm`: ``(gemma_rms_norm(x + residual), x + residual)``."""
    new_residual = x + residual
    return gemma_rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where x is ``[..., 2 * d]`` = gate then up."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU, transformers' ``gelu_pytorch_tanh``) where x is ``[..., 2 * d]``."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prologue: str | None = None,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The unfused ops `kernels.decode_linear` replaces: the prologue's op, then ``F.linear`` in float32
    (rounded to x's dtype once, as a float32-accumulating kernel does)."""
    new_residual = None
    if prologue == "add_rms_norm":
        assert residual is not None and norm_weight is not None
        x, new_residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    elif prologue == "silu_and_mul":
        x = silu_and_mul(x)
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return out if new_residual is None else (out, new_residual)


def norm_and_rotate(q: torch.Tensor, k: torch.Tensor, rotary: RotaryInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """What a backend does with `RotaryInputs`: each q and k head RMS-normalised over its head dim
    when ``rotary`` carries the norm weights (Qwen3's q_norm / k_norm, as HF runs them), then
    `apply_rotary`. The reference of the rotary_kv kernel."""
    if rotary.q_norm_weight is not None:
        q = rms_norm(q, rotary.q_norm_weight, rotary.norm_eps)
        k = rms_norm(k, rotary.k_norm_weight, rotary.norm_eps)
    return apply_rotary(q, k, rotary.positions, rotary.cos_sin_cache)


class Fp8Experts(NamedTuple):
    """Experts of a block-fp8 checkpoint: ``w13`` and ``w2`` in float8_e4m3fn, each ``block = (rows, cols)`` cell
    with its float32 multiplier (the checkpoint's ``weight_scale_inv``): ``w13_scale [E, ceil(rows13 / bn),
    ceil(H / bk)]``, ``w2_scale [E, ceil(H / bn), ceil(I / bk)]``. Each product's input is quantized per token in
    groups of ``bk`` features (`per_token_group_quant_fp8`), as the checkpoint's dense projections are. ``bk`` at
    least H and I (per-row and per-tensor experts): one scale per weight row (or block row) and per token. W8A8 int8
    experts (compressed-tensors' ``*-quantized.w8a8``): ``w13`` and ``w2`` int8 with such a block, each product's
    input quantized to int8 per token, as the dense int8 layers (`int8.int8_linear_fallback`). ``w13_input_scale``,
    ``w2_input_scale``: static activation scales, float32 scalars (`static_quant_fp8`; ``bk`` at least K)."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int]
    w13_input_scale: torch.Tensor | None = None
    w2_input_scale: torch.Tensor | None = None


class IntExperts(NamedTuple):
    """Experts of an AWQ / GPTQ checkpoint, packed: ``w13 [E, 2I, H / p]`` and ``w2 [E, H, I / p]`` int32, each
    output row's ``bits``-bit values packed along its input (``p = 32 / bits`` per int32, the first in the lowest
    bits), with per-group ``*_scales`` and decoded zero points ``*_zeros`` ``[E, rows, inputs / group]``:
    ``W[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group]``, dequantized in float32 and rounded to
    the activations' dtype before each product (as `w4a16_matmul`). GPTQ's act-order experts: ``w13_g_idx`` /
    ``w2_g_idx`` int32 ``[E, inputs]``, the group of each input of the matrix (its scales ``[E, rows, groups]``
    holding every group its inputs name: a tensor-parallel rank's down matrix, all of the whole matrix's), read in
    place of ``k // group``; None: ``k // group``."""

    w13_scales: torch.Tensor
    w13_zeros: torch.Tensor
    w2_scales: torch.Tensor
    w2_zeros: torch.Tensor
    bits: int
    group: int
    w13_g_idx: torch.Tensor | None = None
    w2_g_idx: torch.Tensor | None = None


class Mxfp4Experts(NamedTuple):
    """MXFP4 experts (gpt-oss): w13 uint8 [E, 2I, H/2] and w2 uint8 [E, H, I/2], each output row's e2m1 values packed
    two per byte along its input (the low nibble first: byte j of a row holds inputs 2j and 2j+1), with uint8 e8m0
    exponents (bias 127) per group of 32 inputs: w13_scales [E, 2I, H/32], w2_scales [E, H, I/32].
    W[n, k] = FP4_VALUES[nibble] * 2**(scale[n, k // 32] - 127)."""

    w13_scales: torch.Tensor
    w2_scales: torch.Tensor


def dequantize_int_expert(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
                          g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """One packed expert matrix (`IntExperts`' layout, ``q [N, K / p]``; act-order: each input's group ``g_idx
    [K]``) -> ``W [N, K]`` float32."""
    return dequantize_int_weight(q.t().contiguous(), scales.t(), zeros.t(), g_idx, bits, group).t().contiguous()


class ClampedSwiglu(NamedTuple):
    """gpt-oss's expert activation, in place of SiLU-and-mul: ``gate.clamp(max=limit)``,
    ``up.clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)`` (vLLM's "swigluoai")."""

    alpha: float
    limit: float


def clamped_swiglu(x: torch.Tensor, act: ClampedSwiglu) -> torch.Tensor:
    """`ClampedSwiglu` of x ``[..., 2 * d]`` = gate then up, in transformers' order of operations."""
    d = x.shape[-1] // 2
    gate = x[..., :d].clamp(max=act.limit)
    up = x[..., d:].clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def fused_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None, swiglu: ClampedSwiglu | None = None,
    activation: str = "silu", fp8: Fp8Experts | None = None, int_experts: IntExperts | None = None,
    mxfp4: Mxfp4Experts | None = None,
    lora: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A mixture-of-experts MLP: each token's sum over its k experts of ``weight * down_e(silu(gate_e x) * up_e x)``.

    hidden ``[T, H]``; w13 ``[E, 2I, H]`` (each expert's gate rows, then its up rows); w2 ``[E, H, I]``;
    topk_weights ``[T, k]`` float32; topk_ids ``[T, k]`` integer. An id outside ``[0, E)`` (an expert
    another rank holds, under expert parallelism) adds nothing. Each expert's product is rounded to
    hidden's dtype, scaled by its weight in float32, and summed into the output in hidden's dtype,
    expert by expert in id order (transformers' order). gpt-oss: ``w13_bias [E, 2I]`` and ``w2_bias [E, H]``
    are added after each product (before the routing weight), and ``swiglu`` replaces SiLU-and-mul.
    ``activation="relu2"`` (Nemotron 3): experts without a gate, w13 ``[E, I, H]`` up rows only, and
    ``down_e(relu(up_e x) ** 2)``; ``"gelu_tanh"`` (Gemma 4): ``gelu_tanh(gate) * up`` in place of SiLU's.
    ``fp8``: block-fp8 experts (`Fp8Experts`), each product `w8a8_block_fp8_matmul` of its quantized input (int8
    weights: `int8.int8_linear_fallback`, compressed-tensors' W8A8 int8 forward). ``int_experts``: AWQ / GPTQ experts
    packed (`IntExperts`; w13 and w2 their int32 values), each matrix dequantized before its product. ``mxfp4``:
    gpt-oss's MXFP4 experts (`Mxfp4Experts`; w13 and w2 their uint8 bytes), each matrix dequantized to hidden's dtype
    (`dequantize_mxfp4`, exact) before its product: the float path on the dequantized weights, to the bit. One of
    ``fp8``, ``int_experts``, ``mxfp4``. ``lora(which, expert, token_idx, x)``: LoRA adapters' addition to an expert's
    gate/up (``which`` 0, before the activation) or down (1) product of ``x``, the rows of tokens ``token_idx``
    (asyncllm/models/lora_experts.py)."""
    quants = [q for q in (fp8, int_experts, mxfp4) if q is not None]
    if len(quants) > 1:
        raise ValueError("fp8, int_experts or mxfp4: one at most")
    quant = quants[0] if quants else None
    out = torch.zeros_like(hidden)
    num_experts = w13.shape[0]
    local = (topk_ids >= 0) & (topk_ids < num_experts)
    for expert in torch.unique(topk_ids[local]).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        x = hidden[token_idx]
        gate_up = _add_bias(_expert_product(x, w13, expert, quant, 0), w13_bias, expert)
        if lora is not None:
            gate_up = gate_up + lora(0, expert, token_idx, x)
        act = _expert_activation(gate_up, swiglu, activation)
        down = _add_bias(_expert_product(act, w2, expert, quant, 1), w2_bias, expert)
        if lora is not None:
            down = down + lora(1, expert, token_idx, act)
        out.index_add_(0, token_idx, (down * topk_weights[token_idx, slot, None]).to(hidden.dtype))
    return out


def _expert_product(x: torch.Tensor, w: torch.Tensor, expert: int,
                    quant: Fp8Experts | IntExperts | Mxfp4Experts | None, which: int) -> torch.Tensor:
    """``x @ w[expert].T`` in x's dtype: plain, or (`Fp8Experts`) on x quantized per token group (int8 weights: to
    int8 per token), with the block scales of ``w13`` (``which`` 0) or ``w2`` (1), or (`IntExperts`, `Mxfp4Experts`)
    the packed matrix dequantized first."""
    if quant is None:
        return F.linear(x, w[expert])
    if isinstance(quant, Mxfp4Experts):
        rows, cols = w.shape[1], w.shape[2] * 2
        blocks = w[expert].view(rows, cols // MXFP4_GROUP, MXFP4_GROUP // 2)
        return F.linear(x, dequantize_mxfp4(blocks, quant[which][expert], x.dtype))
    if isinstance(quant, IntExperts):
        scales, zeros, g_idx = ((quant.w13_scales, quant.w13_zeros, quant.w13_g_idx) if which == 0
                                else (quant.w2_scales, quant.w2_zeros, quant.w2_g_idx))
        weight = dequantize_int_expert(w[expert], scales[expert], zeros[expert], quant.bits, quant.group,
                                       None if g_idx is None else g_idx[expert])
        return F.linear(x, weight.to(x.dtype))
    if w.dtype == torch.int8:  # compressed-tensors' forward: the input per token, ``dq(x_q) @ dq(W_q).T`` in float32
        if quant.block[1] < w.shape[2]:
            raise ValueError(f"int8 experts quantize each token's input whole: block {quant.block} must cover all of K")
        scale = expand_block_scales(quant[which][expert], (w.shape[1], 1), quant.block)
        return int8_linear_fallback(x, w[expert], scale, None, x.dtype)
    static = quant.w13_input_scale if which == 0 else quant.w2_input_scale
    x_q, x_s = per_token_group_quant_fp8(x, quant.block[1]) if static is None else static_quant_fp8(x, static)
    return w8a8_block_fp8_matmul(x_q, x_s, w[expert], quant[which][expert], quant.block, x.dtype)


MOE_ACTIVATIONS = ("silu", "relu2", "gelu_tanh")
"""The experts' activations `fused_moe` runs: gated SiLU, gateless relu², gated GELU (tanh)."""


def _expert_activation(gate_up: torch.Tensor, swiglu: ClampedSwiglu | None, activation: str) -> torch.Tensor:
    if activation == "relu2":
        return torch.square(torch.relu(gate_up))
    if activation == "gelu_tanh":
        return gelu_tanh_and_mul(gate_up)
    if activation != "silu":
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    return silu_and_mul(gate_up) if swiglu is None else clamped_swiglu(gate_up, swiglu)


def _add_bias(product: torch.Tensor, bias: torch.Tensor | None, expert: int) -> torch.Tensor:
    """The product, rounded, plus the expert's bias (transformers adds it after the matmul)."""
    return product if bias is None else product + bias[expert]


# ---------------------------------------------------------------- linear attention (Gated DeltaNet)
def gated_delta_step(states: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token of each of N requests through the gated delta rule (Qwen3.5 / Qwen3-Next's decode step).

    ``states [R, Hv, Dk, Dv]`` float32, request n's at row ``rows[n]`` (updated in place); ``q, k [N, Hv, Dk]``,
    ``v [N, Hv, Dv]``, ``g, beta [N, Hv]``, float32 -> ``[N, Hv, Dv]``: ``S <- e^g S``,
    ``S <- S + k (beta (v - S^T k))^T``, output ``S^T q``."""
    state = states[rows] * g.exp()[..., None, None]
    predicted = torch.einsum("nhkv,nhk->nhv", state, k)
    state = state + k.unsqueeze(-1) * ((v - predicted) * beta.unsqueeze(-1)).unsqueeze(-2)
    states[rows] = state
    return torch.einsum("nhkv,nhk->nhv", state, q)


def ssd_decode_step(states: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    dt: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """One token of each of N requests through Mamba2's scan (Granite 4.0, Nemotron-H, Falcon-H1, Bamba decode).

    ``states [R, H, P, S]`` float32, request n's at row ``rows[n]`` (updated in place); ``x [N, H, P]``,
    ``b, c [N, H, S]``, ``dt [N, H]`` (after its softplus), ``a [H]``, float32 -> ``[N, H, P]``:
    ``S <- e^(dt a) S + dt x b^T``, output ``S c`` (without ``D x``)."""
    state = states[rows] * (dt * a).exp()[..., None, None] + (dt[..., None] * x).unsqueeze(-1) * b.unsqueeze(-2)
    states[rows] = state
    return torch.einsum("nhps,nhs->nhp", state, c)
