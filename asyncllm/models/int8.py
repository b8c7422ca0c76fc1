"""W8A8 int8 linear layers: int8 weights with one scale per output row, int8 activations quantized per token on the
fly or with a static per-tensor scale (compressed-tensors ``int-quantized`` checkpoints, RedHatAI's
``*-quantized.w8a8``: asyncllm/models/compressed_tensors.py loads them).

The arithmetic is compressed-tensors' (the forward transformers runs over such a checkpoint):

- a symmetric int8 scale is ``max|x| / 127.5`` (compressed-tensors' ``max|x| / ((127 - (-128)) / 2)``; a zero scale
  becomes float32's eps), one per token (row) for dynamic activations; static activations use the checkpoint's
  calibrated ``input_scale``;
- ``x_q = round(clamp(x / s, -128, 127))`` in float32, rounded half to even (``torch.round``): a row's largest
  positive value saturates at 127, its most negative one may reach -128;
- weights: ``W = float(W_q) * s_W``, ``s_W`` one float32 scale per output row.

The product (`Int8LinearMethod`):

- on CUDA, ``torch._int_mm`` (cuBLAS int8 GEMM, exact int32 sums) scaled after in float32,
  ``(x_q @ W_q^T) * s_x * s_W (+ b)``, cast once to the model dtype. ``_int_mm`` wants more than 16 rows and K and
  N multiples of 8: fewer rows are padded with zero rows to 17 (decode batches; the padding costs 17 x K bytes, far
  less than dequantizing the weight), and a layer whose K or N is not a multiple of 8 takes the fallback; per-token
  activations are quantized there by `kernels/int8_quant.py`'s one Triton kernel, bit for bit `quantize_int8_per_token`;
- elsewhere (the CPU) the dequantize fallback ``F.linear(float(x_q) * s_x, float(W_q) * s_W, b)`` in float32, cast
  once: compressed-tensors' function, and the GPU's up to float32 rounding and summation order.

vLLM's int8 kernels take ``max|x| / 127`` per token (no saturation); asyncllm keeps compressed-tensors' 127.5, the
function the checkpoint is checked against (docs/quantization.md).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # annotations only: the kernels' reference imports this module's math
    from asyncllm.models.linear import LinearBase

__all__ = ["INT8_MIN", "INT8_MAX", "int8_scale", "quantize_int8", "quantize_int8_per_token", "quantize_int8_input",
           "quantize_int8_weight", "int8_linear_fallback", "int8_mm", "int_mm_supported", "Int8LinearMethod",
           "attach_int8_weight"]

logger = logging.getLogger("asyncllm.models")

INT8_MIN, INT8_MAX = -128.0, 127.0
_HALF_RANGE = (INT8_MAX - INT8_MIN) / 2
"""127.5: compressed-tensors' symmetric scale divides ``max|x|`` by half the int8 range."""
_EPS = torch.finfo(torch.float32).eps
"""A zero scale's replacement (compressed-tensors' ``calculate_qparams``): an all-zero row quantizes to zeros."""
_INT_MM_MIN_ROWS = 17
"""``torch._int_mm`` on CUDA refuses 16 rows or fewer."""


# ---------------------------------------------------------------- the math
def int8_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max|x| / 127.5`` in float32, eps where it is zero. The divisor a tensor on ``amax``'s device: CUDA torch takes
    ``tensor / number`` as ``tensor * (1 / number)`` (one float32 rounding more: an ulp apart for some ``amax``), the
    CPU divides; a divided scale is the same on both and `kernels/int8_quant.py`'s (``div_rn``)."""
    amax = amax.float()
    scale = amax / amax.new_full((), _HALF_RANGE)
    return scale.masked_fill_(scale == 0, _EPS)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round(clamp(x / scale, -128, 127))`` as int8, computed in float32, rounded half to even."""
    return (x.float() / scale).clamp_(INT8_MIN, INT8_MAX).round_().to(torch.int8)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (int8 ``[M, K]``, float32 scales ``[M, 1]``), one scale per row. No host sync."""
    scale = int8_scale(x.abs().amax(dim=-1, keepdim=True))
    return quantize_int8(x, scale), scale


def quantize_int8_input(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input ``x [M, K]`` -> (int8 ``[M, K]``, float32 scales ``[M, 1]``): per token when ``input_scale``
    is None, else with that static per-tensor scale repeated for every row."""
    if input_scale is None:
        return quantize_int8_per_token(x)
    return quantize_int8(x, input_scale), input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


@torch.no_grad()
def quantize_int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (int8 ``[N, K]``, float32 ``[N, 1]``): symmetric, one scale per row (``load_format="dummy"``;
    compressed-tensors' min-max scale)."""
    scale = int8_scale(w.abs().amax(dim=1, keepdim=True))
    return quantize_int8(w, scale), scale


def int8_linear_fallback(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                         dtype: torch.dtype, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(dq(q(x)), dq(W_q), b)`` in float32, cast once to ``dtype``; ``weight_scale`` ``[N, 1]`` (or a
    scalar)."""
    x_q, x_scale = quantize_int8_input(x.reshape(-1, x.shape[-1]), input_scale)
    out = F.linear(x_q.float() * x_scale, weight.float() * weight_scale, None if bias is None else bias.float())
    return out.to(dtype).view(*x.shape[:-1], out.shape[-1])


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (int8, ``b`` column-major: a weight's ``.t()``) -> int32 ``[M, N]`` through
    ``torch._int_mm``, ``a`` padded with zero rows to 17 when it has fewer."""
    rows = a.shape[0]
    if rows < _INT_MM_MIN_ROWS:
        a = F.pad(a, (0, 0, 0, _INT_MM_MIN_ROWS - rows))
    return torch._int_mm(a, b)[:rows]


# ---------------------------------------------------------------- the layer's product
@functools.lru_cache(maxsize=None)
def _int_mm_works(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs on ``device``; asked once, at load time, never inside a CUDA-graph capture."""
    a = torch.zeros(32, 32, dtype=torch.int8, device=device)
    try:
        torch._int_mm(a, a.t())
    except (RuntimeError, TypeError, ValueError) as exc:
        logger.info("int8: torch._int_mm does not run on %s (%s): dequantize fallback", device, exc)
        return False
    return True


def int_mm_supported(device: torch.device, in_features: int, out_features: int) -> bool:
    """Whether a ``[out_features, in_features]`` int8 weight multiplies through ``torch._int_mm`` on ``device``: CUDA,
    K and N multiples of 8."""
    return device.type == "cuda" and in_features % 8 == 0 and out_features % 8 == 0 and _int_mm_works(device)


class Int8LinearMethod:
    """A W8A8 int8 layer's product (`LinearBase.quant_method`): ``int_mm``: ``torch._int_mm`` scaled after in
    float32, its per-token input quantized by the Triton kernel (``use_triton``) or `quantize_int8_per_token`; else
    the dequantize fallback (`int8_linear_fallback`). Activations per token, or with the layer's static
    ``input_scale`` (``static_input``)."""

    def __init__(self, int_mm: bool, static_input: bool = False, use_triton: bool = False) -> None:
        self.int_mm = int_mm
        self.static_input = static_input
        self.use_triton = use_triton

    def __repr__(self) -> str:
        scales = ", static input scale" * self.static_input
        quantizer = ", triton quantizer" * (self.int_mm and self.use_triton)
        return f"Int8LinearMethod({'_int_mm' if self.int_mm else 'dequantize'}{scales}{quantizer})"

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = layer.params_dtype
        input_scale = layer.input_scale if self.static_input else None
        if not self.int_mm:
            return int8_linear_fallback(x, layer.weight, layer.weight_scale, bias, dtype, input_scale)
        lead = x.shape[:-1]
        x_q, x_scale = self._quantized_input(x.reshape(-1, x.shape[-1]), input_scale)
        out = int8_mm(x_q, layer.weight.t()).float() * x_scale * layer.weight_scale_row
        out = (out if bias is None else out + bias).to(dtype)
        return out.view(*lead, out.shape[-1])

    def _quantized_input(self, x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if input_scale is None and self.use_triton:
            from asyncllm.kernels.int8_quant import quantize_int8_per_token as triton_quantize

            return triton_quantize(x.contiguous())
        return quantize_int8_input(x, input_scale)


def attach_int8_weight(layer: LinearBase, w_q: torch.Tensor, scale: torch.Tensor,
                       input_scale: torch.Tensor | None = None, int_mm: bool | None = None,
                       use_triton: bool | None = None) -> Int8LinearMethod:
    """Make ``w_q`` (int8 ``[N, K]``) and its ``scale`` (float32 ``[N, 1]``) the layer's weight and route its product
    through an `Int8LinearMethod`; ``input_scale``: a static per-tensor activation scale (None: per token);
    ``int_mm`` None: ``torch._int_mm`` where `int_mm_supported` (True forces it: tests, on the CPU); ``use_triton``
    None: the Triton quantizer on CUDA (True forces it: tests, under Triton's interpreter)."""
    layer.weight = nn.Parameter(w_q, requires_grad=False)
    layer.register_buffer("weight_scale", scale.float())
    if input_scale is not None:
        layer.register_buffer("input_scale", input_scale.float().reshape(()))
    out_features, in_features = w_q.shape
    if int_mm is None:
        int_mm = int_mm_supported(w_q.device, in_features, out_features)
    if int_mm:
        layer.register_buffer("weight_scale_row", scale.float().reshape(1, out_features).contiguous(),
                              persistent=False)
    use_triton = w_q.device.type == "cuda" if use_triton is None else use_triton
    layer.quant_method = Int8LinearMethod(int_mm, input_scale is not None, use_triton)
    return layer.quant_method
