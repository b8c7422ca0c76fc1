"""The pooled-vector encodings of integrations/openai_embed_encoding.py (hypothesis), against torch as the reference.

vLLM's ``tensor2binary`` casts the float32 tensor with ``Tensor.to(dtype)`` and writes its bytes in the byte order
asked for; the module does the same with numpy bit work, and its docstring (and docs/integrations/openai-server.md,
"embed_dtype") promises torch's rounding bit for bit: to nearest, ties to even, subnormals kept, e4m3 saturating at
±448, e5m2 and float16 overflowing to infinity, NaN staying NaN. Drawn float32 values come from raw bit patterns
(subnormals, ties, overflow, infinities, -0.0 and NaNs), ``st.floats(width=32)`` and, for each target format, its
grid: representable values, exact halfway points between neighbours (subnormal ones too), the largest finite value
and the overflow threshold, each nudged by one float32 ulp. For every dtype and ``endianness`` the module's bytes must
equal torch's cast viewed as integers (byteswapped for big endian, ``sys.byteorder`` for native) bit for bit; a NaN
only has to decode as NaN (torch itself writes bfloat16 NaN as 0xFFFF on its vectorised path, 0x7FC0 on the scalar
one, so the payload is no contract). Also: ``encode_vector``'s base64 is those bytes, ``"float"`` answers the float32
values untouched, and the ``"bytes"`` / ``"bytes_only"`` bodies are the vectors' bytes back to back with vLLM's
``metadata`` header (json.dumps key order, contiguous ``start`` / ``end``, ``shape``, usage).
"""

from __future__ import annotations

import base64
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncllm.integrations.openai_embed_encoding import bytes_response, encode_vector, vector_bytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ENDIANNESS = ("native", "big", "little")
# (mantissa bits, smallest normal exponent, largest exponent) of each narrow format
FORMATS = {"float16": (10, -14, 15), "bfloat16": (7, -126, 127), "fp8_e4m3": (3, -6, 8), "fp8_e5m2": (2, -14, 15)}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_UINT = {1: "u1", 2: "u2", 4: "u4"}
EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "250"))
DERANDOMIZE = os.environ.get("PROP_RANDOM") is None


def _order(endianness: str) -> str:
    return {"native": "<" if sys.byteorder == "little" else ">", "little": "<", "big": ">"}[endianness]


def _f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


# --- the reference ---------------------------------------------------------------------------------------------

def torch_bits(values: np.ndarray, embed_dtype: str) -> np.ndarray:
    """torch's cast of the float32 values, as native unsigned integers of the dtype's width."""
    dtype = DTYPES[embed_dtype]
    cast = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1)).to(dtype)
    return cast.view(_TORCH_INT[dtype.itemsize]).numpy().view(_UINT[dtype.itemsize])


def torch_bytes(values: np.ndarray, embed_dtype: str, endianness: str) -> bytes:
    """vLLM's ``tensor2binary``: the cast's bytes in the byte order asked for."""
    bits = torch_bits(values, embed_dtype)
    return bits.astype(bits.dtype.newbyteorder(_order(endianness))).tobytes()


def decode_bits(raw: bytes, embed_dtype: str, endianness: str) -> np.ndarray:
    """Bytes in `embed_dtype` and `endianness` back to native unsigned integers."""
    width = DTYPES[embed_dtype].itemsize
    return np.frombuffer(raw, dtype=_order(endianness) + _UINT[width]).astype(_UINT[width])


def is_nan(bits: np.ndarray, embed_dtype: str) -> np.ndarray:
    dtype = DTYPES[embed_dtype]
    signed = {1: np.uint8, 2: np.int16, 4: np.int32}[dtype.itemsize]
    return torch.isnan(torch.from_numpy(bits.view(signed).copy()).view(dtype).float()).numpy()


# --- strategies ------------------------------------------------------------------------------------------------

raw_float32 = st.integers(0, 2 ** 32 - 1).map(_f32)


@st.composite
def grid_float32(draw) -> float:
    """A value on or halfway between a narrow format's neighbours (normal or subnormal), or near its largest finite
    value, nudged by -1, 0 or +1 float32 ulp, with either sign."""
    mantissa, emin, emax = FORMATS[draw(st.sampled_from(sorted(FORMATS)))]
    kind = draw(st.sampled_from(["normal", "subnormal", "top"]))
    half = draw(st.integers(0, 1))
    if kind == "normal":
        k = draw(st.integers(0, 2 ** mantissa - 1))
        value = math.ldexp(2 ** mantissa + k + half / 2, draw(st.integers(emin - 1, emax + 1)) - mantissa)
    elif kind == "subnormal":
        value = math.ldexp(draw(st.integers(0, 2 ** mantissa + 1)) + half / 2, emin - mantissa)
    else:  # the largest finite, the e4m3fn ceiling's neighbours (1.75 * 2**emax) and the overflow point
        steps = draw(st.integers(2 ** mantissa - 3, 2 ** mantissa + 1))
        value = math.ldexp(2 ** mantissa + steps + half / 2, emax - mantissa)
    value = np.float32(min(value, 3.4e38))
    nudge = draw(st.sampled_from([-np.inf, 0.0, np.inf]))
    if nudge:
        value = np.nextafter(value, np.float32(nudge))
    return float(value) * draw(st.sampled_from([1.0, -1.0]))


float32_values = st.one_of(raw_float32, st.floats(width=32), grid_float32())
vectors = st.lists(float32_values, max_size=24).map(lambda xs: np.array(xs, dtype=np.float32))
finite_vectors = st.lists(st.floats(width=32, allow_nan=False), max_size=12).map(
    lambda xs: np.array(xs, dtype=np.float32).tolist())
embed_dtypes = st.sampled_from(sorted(DTYPES))
endiannesses = st.sampled_from(ENDIANNESS)
EDGES = [448.0, 464.0, _f32(0x43E80001), 480.0, 57344.0, 61440.0, 65504.0, 65520.0, 2.0 ** -9, 2.0 ** -10,
         2.0 ** -17, 1.5 * 2.0 ** -17, 2.0 ** -25, 2.0 ** -134, 1e-45, -0.0, math.inf, -math.inf, 3.4e38]


# --- the properties --------------------------------------------------------------------------------------------

def assert_same_bits(got: bytes, values: np.ndarray, embed_dtype: str, endianness: str) -> None:
    """`got` is torch's bytes exactly where the value is a number; a NaN decodes as NaN."""
    want = torch_bits(values, embed_dtype)
    got_bits = decode_bits(got, embed_dtype, endianness)
    assert got_bits.shape == want.shape, (len(got), values.size)
    nan = np.isnan(values.reshape(-1))
    assert is_nan(got_bits[nan], embed_dtype).all(), got_bits[nan]
    assert not is_nan(got_bits[~nan], embed_dtype).any()
    bad = np.flatnonzero((got_bits != want) & ~nan)
    assert bad.size == 0, [(float(values.reshape(-1)[i]), hex(want[i]), hex(got_bits[i])) for i in bad[:4]]
    if not nan.any():
        assert got == torch_bytes(values, embed_dtype, endianness)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE)
@given(vectors, st.booleans())
@example(np.array(EDGES + [-x for x in EDGES], dtype=np.float32), True)
@example(np.array([math.nan, -math.nan, _f32(0x7F800001), _f32(0xFFFFE000), 1.0], dtype=np.float32), False)
@example(np.array([], dtype=np.float32), True)
def test_casts_are_torchs_bit_for_bit(values: np.ndarray, as_list: bool) -> None:
    vector = values.tolist() if as_list else values
    for embed_dtype in DTYPES:
        for endianness in ENDIANNESS:
            assert_same_bits(vector_bytes(vector, embed_dtype, endianness), values, embed_dtype, endianness)


@settings(max_examples=EXAMPLES // 2, deadline=None, derandomize=DERANDOMIZE)
@given(vectors, embed_dtypes, endiannesses)
@example(np.array([1.0, -2.5, 448.0, 1e-40], dtype=np.float32), "float32", "big")
def test_base64_is_the_bytes(values: np.ndarray, embed_dtype: str, endianness: str) -> None:
    text = encode_vector(values.tolist(), "base64", embed_dtype, endianness)
    assert isinstance(text, str) and text.isascii()
    raw = base64.b64decode(text, validate=True)
    assert len(raw) == values.size * DTYPES[embed_dtype].itemsize
    assert_same_bits(raw, values, embed_dtype, endianness)
    if embed_dtype == "float32":  # the float32 values come back as they went (NaN as NaN)
        back = np.frombuffer(raw, dtype=_order(endianness) + "f4")
        assert np.array_equal(back, values, equal_nan=True)
        assert np.array_equal(np.signbit(back[~np.isnan(back)]), np.signbit(values[~np.isnan(values)]))


@settings(max_examples=EXAMPLES // 3, deadline=None, derandomize=DERANDOMIZE)
@given(finite_vectors, embed_dtypes, endiannesses)
def test_float_answers_the_float32_values(vector: list[float], embed_dtype: str, endianness: str) -> None:
    """``"float"``: the numbers themselves, whatever ``embed_dtype`` and ``endianness`` say."""
    out = encode_vector(list(vector), "float", embed_dtype, endianness)
    assert isinstance(out, list) and len(out) == len(vector)
    assert all(a == b and math.copysign(1, a) == math.copysign(1, b) for a, b in zip(out, vector))
    assert np.array(out, dtype=np.float32).tolist() == vector


@st.composite
def pooled(draw) -> list:
    """Vectors of drawn lengths (0 too), as lists, sometimes a 2-D one (token-level pooling)."""
    out = []
    for _ in range(draw(st.integers(0, 5))):
        rows = draw(st.sampled_from([None, None, None, 1, 3]))
        length = draw(st.integers(0, 6))
        values = draw(st.lists(float32_values, min_size=length * (rows or 1), max_size=length * (rows or 1)))
        array = np.array(values, dtype=np.float32)
        out.append(array.tolist() if rows is None else array.reshape(rows, length).tolist())
    return out


def check_metadata(header: str, vectors: list, body: bytes, req, meta: dict) -> None:
    data = json.loads(header)
    assert header == json.dumps(data)  # Python's json.dumps, vLLM's separators
    assert list(data) == ["id", "created", "model", "data", "usage"]
    assert (data["id"], data["model"]) == (meta["id"], meta["model"])
    assert isinstance(data["created"], int) and meta["t0"] - 1 <= data["created"] <= meta["t1"] + 1
    assert data["usage"] == {"prompt_tokens": meta["tokens"], "total_tokens": meta["tokens"]}
    assert len(data["data"]) == len(vectors)
    offset, width = 0, DTYPES[req.embed_dtype].itemsize
    for index, (item, vector) in enumerate(zip(data["data"], vectors)):
        assert list(item) == ["index", "embed_dtype", "endianness", "start", "end", "shape"]
        shape = list(np.shape(np.array(vector, dtype=np.float32)))
        assert item == {"index": index, "embed_dtype": req.embed_dtype, "endianness": req.endianness,
                        "start": offset, "end": offset + math.prod(shape) * width, "shape": shape}
        assert_same_bits(body[item["start"]:item["end"]], np.array(vector, dtype=np.float32), req.embed_dtype,
                         req.endianness)
        offset = item["end"]
    assert offset == len(body)


@settings(max_examples=EXAMPLES // 3, deadline=None, derandomize=DERANDOMIZE)
@given(pooled(), st.sampled_from(["bytes", "bytes_only"]), embed_dtypes, endiannesses, st.integers(0, 10 ** 6),
       st.text(min_size=1, max_size=8), st.text(min_size=1, max_size=8))
@example([[1.0, 2.0], [], [[3.0, 4.0], [5.0, 6.0]]], "bytes", "fp8_e4m3", "big", 7, "embd-1", "m")
def test_bytes_body_and_metadata(vectors: list, encoding_format: str, embed_dtype: str, endianness: str,
                                 tokens: int, response_id: str, model: str) -> None:
    req = SimpleNamespace(encoding_format=encoding_format, embed_dtype=embed_dtype, endianness=endianness)
    t0 = time.time()
    response = bytes_response(vectors, tokens, response_id, model, req)
    t1 = time.time()
    body = response.body
    assert response.media_type == "application/octet-stream"
    assert response.headers["content-length"] == str(len(body))
    flat = np.concatenate([np.array(v, dtype=np.float32).reshape(-1) for v in vectors] or [np.zeros(0, np.float32)])
    assert_same_bits(body, flat, embed_dtype, endianness)
    if encoding_format == "bytes_only":
        assert "metadata" not in response.headers
        return
    meta = {"id": response_id, "model": model, "tokens": tokens, "t0": int(t0), "t1": int(t1)}
    check_metadata(response.headers["metadata"], vectors, body, req, meta)
