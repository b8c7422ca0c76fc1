"""Property test: prompts given as embeddings, from a tensor (or the OpenAI server's base64 ``prompt_embeds``) to the
rows the engine core gets (`prompt_embeds_of`, and the server's loader in integrations/openai_prompt_embeds.py).

The reference is written from vLLM's behaviour (its ``safe_load_prompt_embeds`` / ``load_prompt_embeds`` and the
processing of an ``EmbedsPrompt``) and asyncllm's documented choices (docs/sampling.md#prompts-given-as-embeddings,
docs/integrations/openai-server.md), not from the code under test:

- server: the entry is strict base64 (no newline, no URL-safe alphabet, padded), ``torch.load(weights_only=True)``
  on the CPU of a tensor (not a dict, list, int...); a sparse tensor is densified, once torch's invariant checks
  pass (an index outside its shape is refused: vLLM's fix of an out-of-bounds write) and when its dense size fits
  the request's byte bound (``max_body_bytes``; vLLM's ``VLLM_MAX_EMBED_DECODE_BYTES``); refusals name
  ``prompt_embeds``;
- engine (both paths): the engine needs ``enable_prompt_embeds`` (a hidden size); the dict has the one key; the
  tensor is dense (the Python API refuses sparse), holds values (not meta), is ``[n, H]`` or ``[1, n, H]`` (the
  batch of one squeezed, as vLLM's squeeze of dim 0; ``[2, n, H]``, 0-D, 1-D and 4-D refused), H the hidden size;
  float32 / bfloat16 / float16 kept as given (documented: vLLM casts to the model's dtype and also takes other
  floats; ints, bool and complex are refused by both); ``repetition_penalty`` and ``prompt_logprobs`` refused;
  ``truncate_prompt_tokens`` keeps the last k rows (-1: max_model_len - 1, max_model_len for pooling; k past that
  refused naming it); no rows left, rows that do not fit ``max_model_len``, or NaN / inf in the kept rows refused;
  refusals name ``prompt.prompt_embeds`` (or the parameter at fault).

Drawn: dtype, shape kind (0-D, 1-D, ``(n, H)``, ``(1, n, H)``, ``(2, n, H)``, wrong H, 4-D, n = 0), values with an
occasional NaN / inf, layout (contiguous, transposed, strided slice, negative-bit view), requires_grad, sparse COO /
CSR (valid or out of bounds), meta; payloads that are not tensors (dict, list of tensors, int, None), base64 made
invalid, bytes that are not a torch file; the path (server or Python API), hidden size or none,
``truncate_prompt_tokens``, pooling, ``max_model_len``, the byte bound; half the draws a good prompt (which only
truncation or ``max_model_len`` may refuse), the others with one drawn fault (shape, dtype, form, values, another
parameter, not a tensor, not strict base64) or any number. Accepted exactly when the reference accepts,
with the reference's rows (bytes, shape and dtype); every refusal an `InvalidRequestError` naming a field the
reference found wrong.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import InvalidRequestError
from asyncllm.engine.prompt_embeds import prompt_embeds_of
from asyncllm.integrations.openai_prompt_embeds import _tensor, completion_embeds_prompts
from asyncllm.integrations.openai_protocol import CompletionRequest, ServerLimits
from asyncllm.sampling import SamplingParams

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "250"))
PROP = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "complex64": torch.complex64}
KEPT_DTYPES = ("float32", "float16", "bfloat16")
LOADER, ENGINE = "prompt_embeds", "prompt.prompt_embeds"
STRICT_B64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
pytestmark = pytest.mark.filterwarnings("ignore:Sparse:UserWarning", "ignore:TypedStorage:UserWarning")


@dataclass
class Case:
    """A drawn prompt: what is sent (`value`: a tensor or any object; `entry`: the server's base64 text) and what
    the reference knows of it (`logical`: the dense values the tensor stands for, None when it has none)."""

    value: Any
    logical: torch.Tensor | None
    kind: str  # "tensor", "sparse", "bad_sparse", "meta", "object", "junk"
    entry: str | None = None


# ---------------------------------------------------------------- the drawn prompts
def _values(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype, fault: str | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    base = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    if base.numel() and (fault == "values" or fault == "wild" and draw(st.integers(0, 3)) == 0):  # NaN / inf
        base.view(-1)[draw(st.integers(0, base.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf")]))
    if dtype == torch.bool:
        return base > 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)  # ints: NaN / inf become whatever the cast makes; ints are refused anyway


def _shape(draw: st.DrawFn, hidden: int, fault: str | None) -> tuple[int, ...]:
    n = draw(st.sampled_from([1, 2, 3, 5, 9]))
    good = [(n, hidden), (1, n, hidden)]
    bad = [(2, n, hidden), (), (hidden,), (n, hidden + 1), (n, max(hidden - 1, 1)), (1, 1, n, hidden),
           (1, n, hidden + 1), (0, hidden), (1, 0, hidden)]
    return draw(st.sampled_from(bad if fault == "shape" else good + bad if fault == "wild" else good))


def _laid_out(draw: st.DrawFn, logical: torch.Tensor) -> torch.Tensor:
    """`logical`'s values in a drawn memory layout: contiguous, transposed, a strided slice, a negative-bit view."""
    how = draw(st.sampled_from(["contiguous", "transposed", "strided", "negative"]))
    if how == "transposed" and logical.dim() >= 2:
        return logical.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "strided" and logical.dim() >= 1:
        wide = torch.zeros((*logical.shape[:-1], 2 * logical.shape[-1]), dtype=logical.dtype)
        wide[..., ::2] = logical
        return wide[..., ::2]
    if how == "negative" and logical.dtype == torch.float32:
        view = torch.complex(torch.zeros_like(logical), -logical).conj().imag  # public ops; is_neg() is set
        assert view.is_neg()
        return view
    return logical.clone()


@st.composite
def tensors(draw: st.DrawFn, hidden: int, fault: str | None) -> Case:
    """A tensor with the drawn `fault` (None: none; "wild": any number of them)."""
    kept, others = list(KEPT_DTYPES), ["float64", *(name for name in sorted(DTYPES) if name not in KEPT_DTYPES)]
    dtype = DTYPES[draw(st.sampled_from(others if fault == "dtype" else kept + others if fault == "wild" else kept))]
    shape = _shape(draw, hidden, fault)
    logical = _values(draw, shape, dtype, fault)
    good, bad = ["plain", "plain", "grad", "sparse"], ["bad_sparse", "meta"]
    form = draw(st.sampled_from(bad if fault == "form" else good + bad if fault == "wild" else good))
    if form == "meta":
        return Case(torch.empty(shape, dtype=dtype, device="meta"), None, "meta")
    if form == "sparse" and logical.dim() >= 1 and dtype != torch.bool:
        csr = logical.dim() == 2 and draw(st.booleans())
        return Case(logical.to_sparse_csr() if csr else logical.to_sparse(), logical, "sparse")
    if form == "bad_sparse" and logical.dim() >= 1 and logical.numel():
        index = torch.zeros((logical.dim(), 1), dtype=torch.int64)
        index[draw(st.integers(0, logical.dim() - 1)), 0] = draw(st.sampled_from([-1, 1 << 20]))
        bad_sparse = torch.sparse_coo_tensor(index, logical.reshape(-1)[:1], logical.shape, check_invariants=False)
        return Case(bad_sparse, None, "bad_sparse")
    value = _laid_out(draw, logical)
    if form == "grad" and dtype.is_floating_point:
        value = value.detach().requires_grad_(True)
    return Case(value, logical, "tensor")


def _saved(value: Any) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@st.composite
def junk(draw: st.DrawFn) -> Case:
    """Base64 that is not strict (a newline, a URL-safe or foreign character, a cut) or bytes that are no torch file."""
    how = draw(st.sampled_from(["newline", "char", "cut", "bytes", "empty"]))
    if how in ("bytes", "empty"):
        data = b"" if how == "empty" else b"not a torch file" + draw(st.binary(max_size=40))
        return Case(None, None, "junk", base64.b64encode(data).decode())
    text = _saved(torch.ones(2, 4))
    spot = draw(st.integers(0, len(text) - 1))
    if how == "newline":
        text = text[:spot] + "\n" + text[spot:]
    elif how == "char":
        text = text[:spot] + draw(st.sampled_from("-_*. ")) + text[spot + 1:]
    else:
        text = text[:-draw(st.integers(1, 3))]
    assert not STRICT_B64.fullmatch(text)
    return Case(None, None, "junk", text)


def _settings(draw: st.DrawFn, fault: str | None) -> dict[str, Any]:
    """The request's other parts: each right, one of them wrong (`fault` "setting"), or any ("wild")."""
    wrong = {"hidden": None, "extra_key": True, "repetition_penalty": 1.3, "prompt_logprobs": 0}
    setting = {"hidden": draw(st.sampled_from([4, 8])), "extra_key": False, "repetition_penalty": 1.0,
               "prompt_logprobs": None}
    if fault == "setting":
        name = draw(st.sampled_from(sorted(wrong)))
        setting[name] = wrong[name]
    elif fault == "wild":
        setting.update({name: value for name, value in wrong.items() if draw(st.integers(0, 5)) == 0})
    mml = draw(st.sampled_from([2, 3, 4, 6, 9, 10, 16, 16, 16]))
    return {**setting, "max_model_len": mml, "pooling": draw(st.sampled_from([None, None, "embedding"])),
            "truncate": draw(st.one_of(st.none(), st.none(), st.just(-1), st.integers(1, mml + 2)))}


@st.composite
def cases(draw: st.DrawFn) -> tuple[Case, dict[str, Any]]:
    server = draw(st.booleans())
    faults = ["shape", "dtype", "dtype", "form", "values", "setting", "object", "base64", "wild"]
    fault = None if draw(st.booleans()) else draw(st.sampled_from(faults))  # half the draws: a good prompt
    setting = {"server": server, "fault": fault, **_settings(draw, fault)}
    hidden = setting["hidden"] or draw(st.sampled_from([4, 8]))
    if fault == "base64" and server:
        case = draw(junk())
    elif fault in ("object", "base64"):
        case = Case(draw(st.sampled_from([{"embeds": torch.ones(2, hidden)}, [torch.ones(2, hidden)], 3, None,
                                          "text"])), None, "object")
    else:
        case = draw(tensors(hidden, fault))
    if server and case.entry is None:
        case.entry = _saved(case.value)
    dense = case.logical.numel() * case.logical.element_size() if case.kind == "sparse" else 1
    setting["max_bytes"] = draw(st.sampled_from([1 << 26, 1 << 26, dense, dense - 1]))  # a sparse one at the bound
    return case, setting


# ---------------------------------------------------------------- the reference
def loader_reference(case: Case, max_bytes: int) -> tuple[str, Any]:
    """vLLM's server loader: ("refused", fields) or ("loaded", logical values or a marker for the engine)."""
    if case.kind == "junk" or case.kind == "bad_sparse":
        return "refused", {LOADER}
    if case.kind == "object" or not isinstance(case.value, torch.Tensor):
        return "refused", {LOADER}
    if case.kind == "sparse" and case.logical.numel() * case.logical.element_size() > max_bytes:
        return "refused", {LOADER}
    return "loaded", "meta" if case.kind == "meta" else case.logical


def engine_reference(logical: Any, s: dict[str, Any]) -> tuple[str, Any]:
    """vLLM's EmbedsPrompt processing with asyncllm's documented choices: ("refused", every field found wrong: the
    refusal may name any) or ("ok", rows). `logical`: the tensor's values, None for what holds none or is refused
    as it is (not a tensor, sparse through the Python API, meta)."""
    bad = set()
    if s["hidden"] is None:
        bad.add(ENGINE)
    if s["extra_key"]:
        bad.add("prompt")
    if s["repetition_penalty"] != 1.0:
        bad.add("repetition_penalty")
    if s["prompt_logprobs"] is not None:
        bad.add("prompt_logprobs")
    rows = None if logical is None or logical.dim() not in (2, 3) else logical
    if rows is not None and rows.dim() == 3:
        rows = rows[0] if rows.shape[0] == 1 else None  # vLLM's squeeze(0): a batch of one only
    if rows is None or rows.shape[1] != s["hidden"] or str(rows.dtype).removeprefix("torch.") not in KEPT_DTYPES:
        return "refused", bad | {ENGINE}
    room = s["max_model_len"] - (0 if s["pooling"] is not None else 1)  # one position left to generate
    k = s["truncate"]
    if k is not None:
        k = room if k == -1 else k
        if not 1 <= k <= room:
            return "refused", bad | {"truncate_prompt_tokens"}
        rows = rows[max(rows.shape[0] - k, 0):]  # the last k rows
    n = rows.shape[0]
    if n == 0 or n > room or not bool(torch.isfinite(rows.to(torch.float64)).all()):
        bad.add(ENGINE)
    return ("refused", bad) if bad else ("ok", rows)


def reference(case: Case, s: dict[str, Any]) -> tuple[str, Any, str]:
    """(verdict, fields or rows, the stage that decides)."""
    logical: Any = case.logical
    if s["server"]:
        verdict, logical = loader_reference(case, s["max_bytes"])
        if verdict == "refused":
            return verdict, logical, "loader"
    if case.kind in ("object", "meta") or (case.kind == "sparse" and not s["server"]) or isinstance(logical, str):
        logical = None  # refused by the engine whatever else is drawn
    verdict, out = engine_reference(logical, s)
    return verdict, out, "engine"


# ---------------------------------------------------------------- the code under test
def run(case: Case, s: dict[str, Any]) -> Any:
    value = _tensor(case.entry, s["max_bytes"]) if s["server"] else case.value
    prompt = {"prompt_embeds": value, **({"prompt_token_ids": [1]} if s["extra_key"] else {})}
    params = SamplingParams(truncate_prompt_tokens=s["truncate"], repetition_penalty=s["repetition_penalty"],
                            prompt_logprobs=s["prompt_logprobs"])
    return prompt_embeds_of(prompt, s["hidden"], params, s["max_model_len"], s["pooling"])


def received_rows(packed: Any) -> torch.Tensor:
    dtype = getattr(torch, packed.dtype)
    return torch.frombuffer(bytearray(packed.data), dtype=dtype).reshape(packed.shape)


@PROP
@given(cases())
def test_embeds_prompt_matches_the_reference(drawn: tuple[Case, dict[str, Any]]) -> None:
    case, s = drawn
    verdict, expected, stage = reference(case, s)
    try:
        packed = run(case, s)
    except InvalidRequestError as exc:
        assert verdict == "refused", f"refused a prompt the reference takes: {exc}"
        assert exc.field in expected, f"{exc} names {exc.field!r}, expected {sorted(expected)} ({stage})"
        if s["fault"] == "setting" and s["hidden"] is None and stage == "engine":  # its one fault: say the option
            assert "enable_prompt_embeds" in exc.message, exc
        return
    assert verdict == "ok", f"accepted a prompt the reference refuses naming {sorted(expected)}"
    assert packed.dtype == str(expected.dtype).removeprefix("torch.")
    assert packed.shape == list(expected.shape)
    assert torch.equal(received_rows(packed), expected.contiguous())


# ---------------------------------------------------------------- the server's request-level checks
@st.composite
def requests(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    entry = _saved(torch.ones(2, 4))
    count = draw(st.integers(0, 4))
    fields: dict[str, Any] = {"prompt_embeds": entry if count == 1 and draw(st.booleans()) else [entry] * count}
    for name, value in (("prompt", "hi"), ("echo", True), ("use_beam_search", True)):
        if draw(st.integers(0, 3)) == 0:
            fields[name] = value
    return fields, draw(st.integers(1, 3))


@settings(max_examples=max(EXAMPLES // 5, 20), deadline=None, database=None,
          derandomize="PROP_EXAMPLES" not in os.environ)
@given(requests())
def test_request_level_checks(drawn: tuple[dict[str, Any], int]) -> None:
    """``prompt``, ``echo`` and ``use_beam_search`` with ``prompt_embeds`` are refused by name (documented: vLLM's
    mixes prompts; asyncllm's is a 400); 1 to ``max_prompts`` entries, each its prompt."""
    fields, max_prompts = drawn
    req = CompletionRequest(model="m", **fields)
    entries = fields["prompt_embeds"]
    count = 1 if isinstance(entries, str) else len(entries)
    bad = {name for name in ("prompt", "echo", "use_beam_search") if name in fields}
    if not bad and not 1 <= count <= max_prompts:
        bad = {LOADER}
    try:
        prompts = asyncio.run(completion_embeds_prompts(req, ServerLimits(max_prompts=max_prompts)))
    except InvalidRequestError as exc:
        assert bad and exc.field in bad, exc
        return
    assert not bad and len(prompts) == count
    assert all(set(p) == {"prompt_embeds"} and torch.equal(p["prompt_embeds"], torch.ones(2, 4)) for p in prompts)


# ---------------------------------------------------------------- plain examples (the bugs fixed 2026-12-07)
def _out_of_bounds_sparse() -> str:
    index = torch.tensor([[0, 1 << 20], [0, 3]])
    return _saved(torch.sparse_coo_tensor(index, torch.ones(2), (4, 8), check_invariants=False))


def test_sparse_tensor_out_of_bounds_is_refused_not_written() -> None:
    """An index outside the declared shape made ``to_dense`` write out of bounds (vLLM's CVE-2025-62164): torch
    2.8+ checks sparse invariants at load only inside ``check_sparse_tensor_invariants``."""
    with pytest.raises(InvalidRequestError) as info:
        _tensor(_out_of_bounds_sparse(), 1 << 26)
    assert info.value.field == LOADER
    assert not torch.sparse.check_sparse_tensor_invariants.is_enabled()  # the process-wide switch is restored


def test_sparse_tensor_declaring_a_huge_shape_is_refused_by_name() -> None:
    """A 2 KB sparse payload declaring (2**30, 2**20) made ``to_dense`` raise an untyped allocation error (a 500;
    smaller shapes allocated gigabytes): its dense size is bounded by what a request may carry."""
    huge = torch.sparse_coo_tensor(torch.zeros((2, 1), dtype=torch.int64), torch.ones(1), (1 << 30, 1 << 20))
    with pytest.raises(InvalidRequestError) as info:
        _tensor(_saved(huge), 1 << 26)
    assert info.value.field == LOADER and "sparse" in info.value.message
