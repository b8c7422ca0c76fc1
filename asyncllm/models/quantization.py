"""Online FP8 weight quantization (``quantization="fp8"``), as vLLM's for a float checkpoint.

After the weights are loaded (or drawn, ``load_format="dummy"``), `quantize_model` turns every parallel
linear layer of the text decoder (`LinearBase`: ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``, a shared expert's projections) into float8_e4m3fn:

- **weights**: one scale per tensor per rank, ``max|W| / 448`` over this rank's whole shard (a fused
  ``qkv_proj`` or ``gate_up_proj`` gets one scale for its q, k and v or gate and up rows: vLLM's
  ``Fp8LinearMethod`` on a float checkpoint, ``scaled_fp8_quant(layer.weight, scale=None)``), stored
  as ``weight`` (1 byte per element) and ``weight_scale`` (a float32 scalar); the bias stays in the
  model dtype;
- **activations**: quantized on the fly, one scale per token (row), ``max|x_row| / 448``, as vLLM does
  on Hopper (``use_per_token_if_dynamic=cutlass_fp8_supported()``);
- **product**: on CUDA with compute capability >= 8.9 ``torch._scaled_mm`` (fp8 x fp8, float32
  accumulation, both scales applied after); elsewhere (the CPU, older GPUs, shapes ``_scaled_mm``
  refuses) the dequantize fallback ``F.linear(dq(x_q), dq(W_q), b)``: the same function up to
  rounding and accumulation order.

Left in the model dtype: embeddings, the LM head, norms, a mixture of experts' routers, and a multimodal
model's encoder and projector (only the ``language_model`` is quantized). The experts (`FusedMoE`, no
`LinearBase`) are quantized per expert matrix by asyncllm/models/fp8_online_experts.py. A layer's LoRA
adapters keep working: they add their products, from the unquantized input, to the fp8 layer's output. docs/quantization.md has the measured errors.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.linear import LinearBase

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_SCALE",
    "QuantizationSummary",
    "Fp8LinearMethod",
    "quantize_fp8",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token",
    "quantize_fp8_input",
    "fp8_to_float",
    "dequantize_fp8",
    "fp8_linear_fallback",
    "quantize_fp8_linear",
    "attach_fp8_weight",
    "disable_fused_decode",
    "quantize_fp8_linears",
    "quantize_model",
    "scaled_mm_supported",
    "tensors_nbytes",
]

logger = logging.getLogger("asyncllm.models")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""Smallest scale (vLLM's ``_FP8_MIN_SCALING_FACTOR``): an all-zero row or tensor quantizes to zeros, not NaN."""
_CHUNK_ELEMENTS = 1 << 24
"""Weights are quantized this many elements at a time, so the float32 copy stays small on the GPU."""


# ---------------------------------------------------------------- the math
def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` rounded to float8_e4m3fn (nearest even), computed in float32: a value past
    the range saturates to +-448 (a bare cast may make it NaN, depending on the torch build)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@torch.no_grad()
def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> (float8_e4m3fn tensor, float32 scalar scale) with ``scale = max|w| / 448``.

    The largest element maps to exactly +-448; ``w ~ q.float() * scale``.
    """
    scale = (w.abs().amax().float() / FP8_MAX).clamp(min=MIN_SCALE)
    if w.dim() < 2 or w.numel() <= _CHUNK_ELEMENTS:
        return quantize_fp8(w, scale), scale
    out = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    rows = max(1, _CHUNK_ELEMENTS // w[0].numel())
    for start in range(0, w.shape[0], rows):
        out[start:start + rows] = quantize_fp8(w[start:start + rows], scale)
    return out, scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (float8_e4m3fn ``[..., K]``, float32 scales ``[..., 1]``): one scale per row,
    ``max|x_row| / 448`` (at least `MIN_SCALE`). No host sync: it runs inside CUDA graphs."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    return quantize_fp8(x, scale), scale


def quantize_fp8_input(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input ``x [M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 scales ``[M, 1]``): per token
    (`quantize_fp8_per_token`) when ``input_scale`` is None, else with that static per-tensor scale (a checkpoint's
    calibrated ``input_scale``) repeated for every row (`reference.static_quant_fp8`, the experts' too)."""
    if input_scale is None:
        return quantize_fp8_per_token(x)
    return reference.static_quant_fp8(x, input_scale)


@functools.lru_cache(maxsize=None)
def _fp8_values() -> torch.Tensor:
    """The 256 float8_e4m3fn values as float32, by bit pattern (CPU)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """``q.float()``, exactly; on the CPU a 256-entry table lookup, three times faster than torch's cast there."""
    if q.device.type != "cpu":
        return q.float()
    return torch.index_select(_fp8_values(), 0, q.view(torch.uint8).reshape(-1).int()).view(q.shape)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` computed in float32, rounded once to ``dtype``."""
    return (fp8_to_float(q) * scale).to(dtype)


def fp8_linear_fallback(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, dtype: torch.dtype,
                        input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantize path: ``F.linear(dq(q(x)), dq(W_q), b)`` in ``dtype``; x quantized per token, or with the
    static ``input_scale``; ``weight_scale`` a scalar or one per output row (``[N, 1]``)."""
    x_q, x_scale = quantize_fp8_input(x.reshape(-1, x.shape[-1]), input_scale)
    out = F.linear(dequantize_fp8(x_q, x_scale, dtype), dequantize_fp8(weight, weight_scale, dtype), bias)
    return out.view(*x.shape[:-1], out.shape[-1])


# ---------------------------------------------------------------- the layer's product
def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs fp8 on ``device``: CUDA with compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _rowwise_scaled_mm_works(device: torch.device) -> bool:
    """Whether this torch build scales ``_scaled_mm`` per row (``[M, 1]`` x ``[1, N]``, bfloat16 out) on
    ``device``; asked once, at load time, never inside a CUDA-graph capture."""
    a = torch.zeros(16, 16, device=device).to(FP8_DTYPE)
    b = torch.zeros(16, 16, device=device).to(FP8_DTYPE)
    try:
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError, ValueError) as exc:
        logger.info("fp8: torch._scaled_mm has no row-wise scaling here (%s): scaled after a float32 product", exc)
        return False
    return True


def _mm_result(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 returned (out, amax)


class Fp8LinearMethod:
    """A quantized layer's product (`LinearBase.quant_method`): fp8 weight (one scale, or one per output row:
    ``per_channel``), fp8 activations (per token, or with the layer's static ``input_scale``: ``static_input``).

    ``scaled_mm``: ``torch._scaled_mm`` (``rowwise``: both scales inside it, bfloat16 models; otherwise
    a float32 product scaled after, vLLM's ``torch_channelwise_w8a8_scaled_mm``). Else the dequantize
    fallback (`fp8_linear_fallback`).
    """

    def __init__(self, scaled_mm: bool, rowwise: bool, per_channel: bool = False, static_input: bool = False) -> None:
        self.scaled_mm = scaled_mm
        self.rowwise = rowwise
        self.per_channel = per_channel
        self.static_input = static_input

    def __repr__(self) -> str:
        kind = ("_scaled_mm rowwise" if self.rowwise else "_scaled_mm") if self.scaled_mm else "dequantize"
        scales = ", per-channel weights" * self.per_channel + ", static input scale" * self.static_input
        return f"Fp8LinearMethod({kind}{scales})"

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = layer.params_dtype
        input_scale = layer.input_scale if self.static_input else None
        if not self.scaled_mm:
            return fp8_linear_fallback(x, layer.weight, layer.weight_scale, bias, dtype, input_scale)
        lead = x.shape[:-1]
        x_q, x_scale = quantize_fp8_input(x.reshape(-1, x.shape[-1]), input_scale)
        weight_t = layer.weight.t()  # [K, N] column-major, as _scaled_mm wants its second operand
        if self.rowwise:
            out = _mm_result(torch._scaled_mm(x_q, weight_t, scale_a=x_scale, scale_b=layer.weight_scale_row,
                                              out_dtype=dtype))
            if bias is not None:
                out = out + bias
        else:
            scale_b = layer.unit_scale if self.per_channel else layer.weight_scale  # a tensor-wise scale: a scalar
            out = _mm_result(torch._scaled_mm(x_q, weight_t, scale_a=layer.unit_scale, scale_b=scale_b,
                                              out_dtype=torch.float32))
            out = out * x_scale
            if self.per_channel:
                out = out * layer.weight_scale_row
            out = (out if bias is None else out + bias).to(dtype)
        return out.view(*lead, out.shape[-1])


# ---------------------------------------------------------------- quantizing a model
@dataclass(frozen=True)
class QuantizationSummary:
    """What one online fp8 pass did on this rank: `quantize_fp8_linears`, or the experts' `quantize_fp8_experts`."""

    num_layers: int
    bytes_before: int
    """The quantized layers' weights in the model dtype."""
    bytes_after: int
    """The same weights in fp8, with their scales."""
    method: str
    """How the products run: ``_scaled_mm`` or ``dequantize`` (linears: both, ``+``-joined, when layers differ;
    ``none`` without layers), ``fused_moe`` or ``dequantize`` (experts)."""


@torch.no_grad()
def quantize_fp8_linear(layer: LinearBase) -> Fp8LinearMethod:
    """Replace ``layer.weight`` by its fp8 quantization (plus ``weight_scale``) and route its product
    through an `Fp8LinearMethod`. The model-dtype weight is freed as soon as nothing else holds it."""
    weight = layer.weight
    assert weight.dtype != FP8_DTYPE and layer.quant_method is None, "already quantized"
    return attach_fp8_weight(layer, *quantize_fp8_per_tensor(weight.data))


def attach_fp8_weight(layer: LinearBase, w_q: torch.Tensor, scale: torch.Tensor,
                      input_scale: torch.Tensor | None = None) -> Fp8LinearMethod:
    """Make ``w_q`` (float8_e4m3fn ``[N, K]``) and its ``scale`` (a scalar, or float32 ``[N, 1]``: one per output
    row) the layer's weight, and route its product through an `Fp8LinearMethod` (the online path, and pre-quantized
    checkpoints); ``input_scale``: a static per-tensor activation scale (None: per token)."""
    layer.weight = nn.Parameter(w_q, requires_grad=False)
    layer.register_buffer("weight_scale", scale)
    out_features, in_features = w_q.shape
    per_channel = scale.numel() > 1
    if input_scale is not None:
        layer.register_buffer("input_scale", input_scale.float().reshape(()))
    # _scaled_mm wants both dims of the weight, and the activation's K, to be multiples of 16
    scaled_mm = scaled_mm_supported(w_q.device) and in_features % 16 == 0 and out_features % 16 == 0
    rowwise = scaled_mm and layer.params_dtype == torch.bfloat16 and _rowwise_scaled_mm_works(w_q.device)
    if rowwise or (scaled_mm and per_channel):
        row = scale.reshape(1, out_features) if per_channel else scale.expand(1, out_features)
        layer.register_buffer("weight_scale_row", row.contiguous(), persistent=False)
    if scaled_mm and not rowwise:
        layer.register_buffer("unit_scale", torch.ones((), dtype=torch.float32, device=w_q.device), persistent=False)
    layer.quant_method = Fp8LinearMethod(scaled_mm, rowwise, per_channel, input_scale is not None)
    return layer.quant_method


def _text_decoder(model: nn.Module) -> nn.Module:
    """The part of the model whose linears are quantized: a multimodal model's language model, else all."""
    language_model = getattr(model, "language_model", None)
    return language_model if isinstance(language_model, nn.Module) else model


def disable_fused_decode(model: nn.Module) -> None:
    """Turn off the decoder layers' fused decode path: kernels/decode_linear.py reads model-dtype weights."""
    for module in model.modules():
        if getattr(module, "fused_decode_rows", 0):
            module.fused_decode_rows = 0


def tensors_nbytes(*tensors: torch.Tensor) -> int:
    """The bytes the tensors' elements take, all together."""
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def quantize_fp8_linears(model: nn.Module) -> QuantizationSummary:
    """Quantize every parallel linear layer (`LinearBase`) of the model's text decoder to fp8.

    Any other module (embeddings, LM head, norms, MoE routers and experts, a vision tower) is left as it
    is, and so is a layer marked `quantized_layers.keep_float` (an MTP layer's entry projection: vLLM's plain
    ``nn.Linear``). The decoder layers' fused decode path (ASYNCLLM_DECODE_LINEAR, which reads the weights
    directly) is turned off.
    """
    decoder = _text_decoder(model)
    layers = [module for module in decoder.modules()
              if isinstance(module, LinearBase) and not getattr(module, "keeps_float", False)]
    before = after = 0
    methods = set()
    for layer in layers:
        before += tensors_nbytes(layer.weight)
        methods.add("_scaled_mm" if quantize_fp8_linear(layer).scaled_mm else "dequantize")
        after += tensors_nbytes(layer.weight, layer.weight_scale)
    disable_fused_decode(decoder)
    devices = {layer.weight.device for layer in layers}
    if any(device.type == "cuda" for device in devices):
        torch.cuda.empty_cache()  # the model-dtype weights' memory goes back before the KV cache is sized
    return QuantizationSummary(len(layers), before, after, "+".join(sorted(methods)) or "none")


def quantize_model(model: nn.Module, method: str) -> None:
    """Quantize a loaded model in place with ``method`` (the `quantization` field), and log what this rank
    quantized: its linear layers, and its experts when it has any."""
    if method != "fp8":
        raise NotBuiltError("quantization", method, f"{method!r} weight quantization (only 'fp8')")
    from asyncllm.models.fp8_online_experts import quantize_fp8_experts

    experts = quantize_fp8_experts(_text_decoder(model))  # first: the linears' pass empties the CUDA cache
    linears = quantize_fp8_linears(model)
    for kind, done in (("linear", linears), ("expert", experts)):
        if done.num_layers or kind == "linear":
            logger.info("fp8: %d %s layers quantized, %.1f MiB -> %.1f MiB (%s)", done.num_layers, kind,
                        done.bytes_before / 2**20, done.bytes_after / 2**20, done.method)
