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

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
# compressed-tensors' W8A8 int8 math, defined once in models.int8: `quantize_int8_per_token` is the reference of
# the Triton `int8_quant.quantize_int8_per_token` (W8A8 int8 experts' inputs)
from asyncllm.models.int8 import INT8_MAX, INT8_MIN, int8_linear_fallback, quantize_int8_per_token
from asyncllm.models.mxfp4 import MXFP4_GROUP, dequantize_mxfp4
# the quantized products' references (block fp8, static fp8, integer weight-only), re-exported as this module's own
from asyncllm.kernels.reference_quant import (
    FP8_E4M3_MAX, FP8_MIN_SCALE, dequantize_fp8_blocks, dequantize_int_weight, expand_block_scales,
    per_token_group_quant_fp8, static_quant_fp8, unpack_int_rows, w4a16_matmul, w8a8_block_fp8_matmul,
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (GPT-NeoX rotary layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def build_cos_sin_cache(inv_freq: torch.Tensor, attention_scaling: float, max_position: int) -> torch.Tensor:
    """``[max_position, rotary_dim]`` float32: cos for the first half, sin for the second.

    Computed like HF's rotary embedding (``position.float() * inv_freq`` then cos/sin
    times the scaling), so the values are bit-identical to transformers'.
    """
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.to(torch.float32)[None, :]
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by their token's position (NeoX style).

    The rotary dim is ``cos_sin_cache.shape[-1]``; dims past it pass through
    unchanged (partial rotary). cos/sin are cast to q's dtype before the products,
    as HF does. Returns new tensors.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if rotary_dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)

    return rotate(q), rotate(k)


def norm_and_rotate(q: torch.Tensor, k: torch.Tensor, rotary: RotaryInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """What a backend does with `RotaryInputs`: each q and k head RMS-normalised over its head dim
    when ``rotary`` carries the norm weights (Qwen3's q_norm / k_norm, as HF runs them), then
    `apply_rotary`. The reference of the rotary_kv kernel."""
    if rotary.q_norm_weight is not None:
        q = rms_norm(q, rotary.q_norm_weight, rotary.norm_eps)
        k = rms_norm(k, rotary.k_norm_weight, rotary.norm_eps)
    return apply_rotary(q, k, rotary.positions, rotary.cos_sin_cache)


def to_kv_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a KV cache of ``dtype`` stores it: an fp8 type (scale 1.0) rounds to the nearest value and
    saturates at the largest finite one (as vLLM's conversion and the Triton KV write do); others cast."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
                   ) -> None:
    """Store k, v ``[T, Hkv, D]`` into ``kv_cache [2, num_blocks, block_size, Hkv, D]`` at their slots,
    cast to the cache's dtype (`to_kv_cache_dtype`: an fp8 cache holds the nearest fp8 values). ``v`` None: a
    one-part cache ``[1, ...]`` whose keys are the values too (latent attention).

    A negative slot marks a padding token, which is not written.
    """
    assert (v is None) == (kv_cache.shape[0] == 1), "values go to a two-part cache, none to a one-part cache"
    parts = [k] if v is None else [k, v]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, parts = slots[valid], [x[valid] for x in parts]
    parts = [to_kv_cache_dtype(x, kv_cache.dtype) for x in parts]
    if kv_cache.dtype.itemsize == 1:  # torch's CPU index_copy_ has no float8 kernel: copy the bytes
        kv_cache, parts = kv_cache.view(torch.uint8), [x.view(torch.uint8) for x in parts]
    for cache, x in zip(kv_cache, parts):
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, x)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached K and V ``[seq_len, Hkv, D]`` of one request, in order (of a one-part cache: its
    keys twice)."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].to(torch.long)
    raw = kv_cache.view(torch.uint8) if kv_cache.dtype.itemsize == 1 else kv_cache  # fp8: gather the bytes
    key = raw[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].view(kv_cache.dtype)
    value = raw[-1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].view(kv_cache.dtype)
    return key, value


def _context_mask(
    q_len: int, seq_len: int, sliding_window: int | None, device: torch.device, limit: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor | None:
    """Boolean ``[q_len, seq_len]`` (True = attend), or None when every key is visible.

    Query j sits at position ``seq_len - q_len + j``; it sees keys at or before it (at or before
    ``limit[j]`` when a ``[q_len]`` limit is given: `AttentionMetadata.attend_limit`), and with a
    sliding window only those after its own position minus ``sliding_window`` (HF's rule). With
    ``chunk_size`` C (Llama 4's chunked local attention) only the keys of its own chunk of C positions
    too: those at or after ``(position // C) * C`` (transformers' ``create_chunked_causal_mask``).
    """
    window_covers_all = sliding_window is None or sliding_window >= seq_len
    chunk_covers_all = chunk_size is None or chunk_size >= seq_len  # every position is in chunk 0
    if q_len == 1 and window_covers_all and chunk_covers_all and limit is None:
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= (q_pos if limit is None else limit.to(device)[:, None])
    if not window_covers_all:
        mask &= k_pos > q_pos - sliding_window
    if not chunk_covers_all:
        mask &= k_pos >= q_pos // chunk_size * chunk_size
    return mask


def alibi_bias(alibi_slopes: torch.Tensor, q_len: int, seq_len: int) -> torch.Tensor:
    """ALiBi's float32 score bias ``[H, q_len, seq_len]``: ``slope_h * (key_pos - query_pos)``, query j at position
    ``seq_len - q_len + j``. Relative to the query, so it stays small near the diagonal at any length; softmax is
    blind to the per-row constant by which it differs from BLOOM's and MPT's ``slope_h * key_pos``."""
    device = alibi_slopes.device
    distance = (torch.arange(seq_len, device=device)[None, :]
                - torch.arange(seq_len - q_len, seq_len, device=device)[:, None])
    return alibi_slopes.float()[:, None, None] * distance.float()


def _eager_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None, sinks: torch.Tensor | None, alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with explicit scores, in transformers' eager order: capped to ``softcap * tanh(q.k * scale /
    softcap)`` when ``softcap`` (Gemma 2), ALiBi's bias added in float32 when ``alibi_slopes [H]`` (BLOOM, MPT:
    `alibi_bias`), masked, joined by each head's sink logit ``sinks [H]`` as one more
    column of the softmax (gpt-oss: it takes probability mass and adds no value), a float32 softmax rounded to
    the dtype, then ``P @ V``. ``[H, L, D]`` heads first."""
    groups = query.shape[0] // key.shape[0]
    key, value = key.repeat_interleave(groups, 0), value.repeat_interleave(groups, 0)
    scores = query @ key.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        scores = scores.float() + alibi_bias(alibi_slopes, scores.shape[1], scores.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ value
    sink_column = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1, dtype=torch.float32)
    return probs[..., :-1].to(query.dtype) @ value


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of each request's queries over its whole cached context.

    ``query`` is ``[T, Hq, D]`` for the flattened step; the step's K/V must already be
    in ``kv_cache`` (of query's dtype, or fp8: the gathered K/V are cast to query's dtype).
    Returns ``[T, Hq, D]``; rows past ``query_start_loc[-1]`` (padding) are zero. One
    ``scaled_dot_product_attention`` call per request; with ``softcap`` (Gemma 2's
    attn_logit_softcapping; None or 0 is off) the scores are capped first, and with ``sinks`` (gpt-oss: a
    logit per query head, ``[Hq]``) each softmax's denominator takes ``exp(sink)`` too (`_eager_attention`).
    With ``metadata.attend_limit`` a query sees the keys up to its limit instead of its own position.
    With ``attention_chunk_size`` C (Llama 4's chunked local layers; None: off) a query at position p sees
    only the keys at or after ``(p // C) * C`` too (`_context_mask`); a layer has a window or a chunk size,
    never both (ValueError). With ``alibi_slopes`` (``[Hq]`` float32: BLOOM, MPT) each score gets
    ``slope_h * (key_pos - query_pos)`` added before the mask (`alibi_bias`).
    """
    if attention_chunk_size is not None:
        if sliding_window is not None:
            raise ValueError(f"a layer has sliding_window ({sliding_window}) or attention_chunk_size "
                             f"({attention_chunk_size}), not both")
        if attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1: {attention_chunk_size}")
    out = torch.zeros_like(query)
    qsl = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        key, value = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
        limit = None if metadata.attend_limit is None else metadata.attend_limit[start:end]
        mask = _context_mask(end - start, seq_len, sliding_window, query.device, limit, attention_chunk_size)
        q = query[start:end].transpose(0, 1)
        k, v = (t.transpose(0, 1).to(query.dtype) for t in (key, value))
        if softcap or sinks is not None or alibi_slopes is not None:
            attended = _eager_attention(q, k, v, mask, scale, softcap, sinks, alibi_slopes)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended.transpose(0, 1)
    return out


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
