"""vLLM's encodings of pooled vectors (``/v1/embeddings``, ``/pooling``): ``encoding_format``, ``embed_dtype`` and
``endianness``, torch-free (numpy bit work, as the host process is: docs/architecture.md).

``"float"`` answers the float32 values as numbers; ``"base64"`` each vector's bytes in ``embed_dtype`` (float32,
float16, bfloat16, fp8 e4m3 / e5m2) and byte order ``endianness`` (``"native"``: the server's, ``sys.byteorder``),
base64-encoded; ``"bytes"`` the vectors' bytes one after the other as an ``application/octet-stream`` body, with
vLLM's ``metadata`` header (JSON: id, created, model, each vector's ``index``, ``embed_dtype``, ``endianness``,
``start`` / ``end`` byte offsets and ``shape``, and usage); ``"bytes_only"`` the body without the header. The
conversions round as torch's ``Tensor.to(dtype)`` on a float32 tensor does (vLLM's ``tensor2binary``): to nearest,
ties to even, subnormals kept; fp8 e4m3 saturates past its largest finite value (±448), e5m2 overflows to infinity.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
from starlette.responses import Response

__all__ = ["EmbedDType", "Endianness", "EncodingFormat", "BYTES_FORMATS", "vector_bytes", "encode_vector",
           "bytes_response"]

EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
"""vLLM's ``embed_dtype``: the dtype of base64 and bytes results."""
Endianness = Literal["native", "big", "little"]
"""vLLM's ``endianness`` of base64 and bytes results; ``"native"``: the server's (``sys.byteorder``)."""
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
"""vLLM's ``encoding_format`` of /v1/embeddings and /pooling."""
BYTES_FORMATS = ("bytes", "bytes_only")
"""The formats answered as a binary body, not JSON."""

_BYTE_ORDERS = {"native": "=", "little": "<", "big": ">"}
_F32_INF = 0x7F800000


def _float32_bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint32)


def _float16_bits(values: np.ndarray) -> np.ndarray:
    """numpy's float32 -> float16 cast: to nearest even, subnormals kept, overflow to infinity (torch's too)."""
    return values.astype(np.float16).view(np.uint16)


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """The top 16 bits rounded to nearest even (c10::BFloat16's ``round_to_nearest_even``); NaN a quiet NaN."""
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(values), 0x7FC0, rounded).astype(np.uint16)


def _fp8_bits(values: np.ndarray, mantissa: int, bias: int, limit: int, overflow: int) -> np.ndarray:
    """torch's float32 -> fp8 cast (``fp8e4m3fn_from_fp32_value``, ``fp8e5m2_from_fp32_value``): `mantissa` bits,
    exponent `bias`; a magnitude from `limit` (float32 bits) up, or rounded past the largest finite value, answers
    `overflow` (e4m3fn's largest finite, e5m2's infinity), NaN the all-ones pattern; subnormals by a float32 add."""
    bits = values.view(np.uint32).astype(np.int64)
    sign, magnitude = (bits >> 24) & 0x80, bits & 0x7FFFFFFF
    shift = 23 - mantissa
    denorm = (127 - bias + shift + 1) << 23
    tiny = magnitude.astype(np.uint32).view(np.float32) + np.uint32(denorm).view(np.float32)
    subnormal = tiny.view(np.uint32).astype(np.int64) - denorm
    odd = (magnitude >> shift) & 1
    normal = np.minimum((magnitude + ((bias - 127) << 23) + (1 << (shift - 1)) - 1 + odd) >> shift, overflow)
    out = np.where(magnitude < (128 - bias) << 23, subnormal, normal)
    out = np.where(magnitude >= limit, overflow, out)
    out = np.where(magnitude > _F32_INF, 0x7F, out)
    return (out | sign).astype(np.uint8)


_CASTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "float32": _float32_bits, "float16": _float16_bits, "bfloat16": _bfloat16_bits,
    "fp8_e4m3": lambda values: _fp8_bits(values, mantissa=3, bias=7, limit=0x43F00000, overflow=0x7E),  # 480.0
    "fp8_e5m2": lambda values: _fp8_bits(values, mantissa=2, bias=15, limit=0x47800000, overflow=0x7C)}  # 65536.0


def vector_bytes(vector: Sequence[float], embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """A vector's values as float32, cast to `embed_dtype`, in the byte order `endianness` (vLLM's
    ``tensor2binary``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        bits = _CASTS[embed_dtype](np.asarray(vector, dtype=np.float32).reshape(-1))
    return bits.astype(bits.dtype.newbyteorder(_BYTE_ORDERS[endianness]), copy=False).tobytes()


def encode_vector(vector: list[float], encoding_format: str, embed_dtype: str = "float32",
                  endianness: str = "native") -> list[float] | str:
    """A JSON response's vector: its numbers (``"float"``), or the base64 text of its `vector_bytes`."""
    if encoding_format == "base64":
        return base64.b64encode(vector_bytes(vector, embed_dtype, endianness)).decode("ascii")
    return vector


def bytes_response(vectors: Sequence[Sequence[float]], prompt_tokens: int, response_id: str, model: str,
                   req: Any) -> Response:
    """The vectors' bytes one after the other (``application/octet-stream``); for ``"bytes"`` vLLM's ``metadata``
    header: the response's id, created and model, each vector's ``index``, ``embed_dtype``, ``endianness``, byte
    range (``start``, ``end``) and ``shape``, and ``usage`` (`prompt_tokens`); ``"bytes_only"``: no header.
    `req` has ``encoding_format``, ``embed_dtype`` and ``endianness``."""
    chunks = [vector_bytes(vector, req.embed_dtype, req.endianness) for vector in vectors]
    headers = None
    if req.encoding_format == "bytes":
        headers = {"metadata": json.dumps({"id": response_id, "created": int(time.time()), "model": model,
                                           "data": _items(vectors, chunks, req),
                                           "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})}
    return Response(b"".join(chunks), media_type="application/octet-stream", headers=headers)


def _items(vectors: Sequence[Sequence[float]], chunks: list[bytes], req: Any) -> list[dict[str, Any]]:
    """vLLM's ``MetadataItem`` of each vector, in its order (``json.dumps``'d as vLLM's)."""
    items, offset = [], 0
    for index, (vector, chunk) in enumerate(zip(vectors, chunks)):
        items.append({"index": index, "embed_dtype": req.embed_dtype, "endianness": req.endianness,
                      "start": offset, "end": offset + len(chunk), "shape": list(np.shape(vector))})
        offset += len(chunk)
    return items

