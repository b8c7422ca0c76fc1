"""Property test: `SamplingParams` construction, `validate()` and the engine's checks of params before admission
(`check_params_text`, `check_params_vocab`, `check_logprobs_limit`, `check_allowed_tokens`, `truncation_length`).

Users build `SamplingParams` in Python and hand it to `engine.stream`, so every bad field must come back as an
`InvalidRequestError` whose `.field` names it, never another exception and never silently accepted; good params
must pass with only the documented normalizations (docs/sampling.md's Parameters table: numpy scalars as Python
numbers, seed -1 as None, a stop string as a list, None as [] for the list fields, repeats of stop_token_ids and
allowed_token_ids dropped in first-seen order, str logit_bias keys as ints, output_kind names and values as the enum,
structured dicts and vLLM's structured_outputs / guided_decoding aliases as `StructuredOutputs`).

Drawn: a subset of fields, each valid or from a pool of wrong values (bool for int, NaN, inf, huge ints, numpy
scalars, out-of-range, negative ids, ids past the vocabulary), and an engine (vocabulary, max_logprobs,
max_model_len). A plain reference written from the docs says "valid, normalized to X" or "invalid, naming one of
these fields"; several bad fields may be named in any order, but the engine's checks run only on params that
`validate()` passed (validation.py), so their fields count only then. Valid params must also validate again
unchanged and survive the msgspec wire (the core decodes them).
"""

from __future__ import annotations

import copy
import functools
import math
import os
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from drawn_fields import admitted, drawn_fields

from asyncllm import RequestOutputKind, SamplingParams, StructuredOutputs
from asyncllm.engine.validation import (check_allowed_tokens, check_logprobs_limit, check_params_text,
                                        check_params_vocab, truncation_length)

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "1500"))
I32 = 2**31 - 1
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # configuration.md
DEFAULTS: dict[str, Any] = {
    "n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "max_tokens": 16,
    "min_tokens": 0, "stop": [], "stop_token_ids": [], "ignore_eos": False, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None, "logprobs": None,
    "prompt_logprobs": None, "output_kind": RequestOutputKind.DELTA, "structured": None, "allowed_token_ids": None,
    "bad_words": [], "bad_words_token_ids": [], "truncate_prompt_tokens": None, "detokenize": True,
    "logprobs_mode": None, "structured_outputs": None, "guided_decoding": None}
BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
         "detokenize")
FLOAT_RANGES = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
                "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
                "repetition_penalty": (2.0**-31, 2.0**31)}
INT_RANGES = {"n": (1, I32), "top_k": (-1, I32), "min_tokens": (0, I32)}
ALIASES = ("structured", "structured_outputs", "guided_decoding")
BAD = object()
"""The reference's "this field is invalid"."""


# ---------------------------------------------------------------- the reference, from docs/sampling.md
def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def plain(v: Any) -> Any:
    """A numpy integer or float scalar as Python's number; numpy's bool stays (a bool field takes Python's only)."""
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return v


def ok_float(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v)) \
        and lo <= v <= hi


def ok_ids(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(t) and t >= 0 for t in v)


def distinct(ids: list[int]) -> list[int]:
    out: list[int] = []
    for t in ids:
        if t not in out:
            out.append(t)
    return out


def ref_scalar(name: str, v: Any) -> Any:
    """The normalized value of a numeric field, or BAD."""
    v = plain(v)
    if name in FLOAT_RANGES:
        lo, hi = FLOAT_RANGES[name]
        return v if ok_float(v, lo, hi) and not (name == "top_p" and v == 0) else BAD
    if name in INT_RANGES:
        lo, hi = INT_RANGES[name]
        return v if is_int(v) and lo <= v <= hi else BAD
    if name == "seed":
        return None if v is None or (is_int(v) and v == -1) else v if is_int(v) and -2**63 <= v < 2**63 else BAD
    if name == "max_tokens":
        return v if v is None or is_int(v) and 1 <= v <= I32 else BAD
    if name == "truncate_prompt_tokens":
        return v if v is None or is_int(v) and (v == -1 or 1 <= v <= I32) else BAD
    if name in ("logprobs", "prompt_logprobs"):
        return v if v is None or is_int(v) and -1 <= v <= I32 else BAD
    raise AssertionError(name)


def ref_logit_bias(v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, dict):
        return BAD
    out = {}
    for key, bias in v.items():
        if isinstance(key, str):
            key = int(key) if key.strip().lstrip("-").isascii() and key.strip().lstrip("-").isdigit() else key
        key, bias = plain(key), plain(bias)
        if not (is_int(key) and key >= 0 and ok_float(bias, -100.0, 100.0)):
            return BAD
        out[key] = bias
    return out


def ref_output_kind(v: Any) -> Any:
    if isinstance(v, RequestOutputKind):
        return v
    if isinstance(v, str) and v.upper() in RequestOutputKind.__members__:
        return RequestOutputKind[v.upper()]
    if type(v) is int and v in (0, 1, 2):
        return RequestOutputKind(v)
    return BAD


def ref_lists(name: str, v: Any) -> Any:
    if name == "stop":
        v = [] if v is None else [v] if isinstance(v, str) else v
        return v if isinstance(v, list) and all(isinstance(s, str) and s for s in v) else BAD
    if name == "stop_token_ids":
        v = [] if v is None else v
        return distinct(v) if ok_ids(v) else BAD
    if name == "allowed_token_ids":
        return v if v is None else distinct(v) if ok_ids(v) and v else BAD
    if name == "bad_words":
        v = [] if v is None else v
        good = isinstance(v, list) and len(v) <= 128 and all(isinstance(w, str) and w.strip() for w in v)
        return v if good and sum(map(len, v)) <= 1024 * 64 else BAD
    v = [] if v is None else v  # bad_words_token_ids
    good = isinstance(v, list) and len(v) <= 128 and all(isinstance(s, list) and s and ok_ids(s) for s in v)
    return v if good and sum(map(len, v)) <= 1024 else BAD


def ref_structured(name: str, v: Any) -> Any:
    """A `StructuredOutputs` (vLLM's dict or object read as docs/sampling.md says), or BAD."""
    if v is None or isinstance(v, StructuredOutputs):
        return v
    if not isinstance(v, dict):
        return BAD
    if name == "structured":
        return StructuredOutputs(**v) if set(v) <= {"json", "regex", "choice", "grammar"} else BAD
    v = {k: x for k, x in v.items() if x is not None and not k.startswith("_")
         and (x is not False or k in ("json", "regex", "choice", "grammar"))}  # unset and private: ignored
    json_object, backend = v.pop("json_object", False), v.pop("backend", "auto")
    if backend not in ("auto", "xgrammar") or not set(v) <= {"json", "regex", "choice", "grammar"} \
            or json_object not in (True, False):  # (1 and 0 too)
        return BAD
    if json_object:
        if "json" in v:
            return BAD
        v["json"] = {"type": "object"}
    return StructuredOutputs(**v)


def structured_ok(s: StructuredOutputs) -> bool:
    kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(s, k) is not None]
    if len(kinds) != 1:
        return False
    value = getattr(s, kinds[0])
    if kinds[0] == "choice":
        return isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)
    return isinstance(value, dict) if kinds[0] == "json" else isinstance(value, str) and bool(value)


def ref_field(name: str, v: Any) -> Any:
    if name in BOOLS:
        return v if isinstance(v, bool) else BAD
    if name == "logit_bias":
        return ref_logit_bias(v)
    if name == "output_kind":
        return ref_output_kind(v)
    if name == "logprobs_mode":
        return v if v is None or v in MODES else BAD
    if name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words", "bad_words_token_ids"):
        return ref_lists(name, v)
    return ref_scalar(name, v)


def reference(fields: dict[str, Any], vocab: int, max_logprobs: int, max_model_len: int):
    """(normalized fields, None) for admitted params, else (None, the fields the error may name)."""
    aliases = [a for a in ALIASES if fields.get(a) is not None]
    if len(aliases) > 1:
        return None, set(aliases[1:])
    out, bad = dict(DEFAULTS), set()
    if aliases:
        structured = ref_structured(aliases[0], fields[aliases[0]])
        if structured is BAD and aliases[0] != "structured":
            return None, {aliases[0]}  # read at construction
        out["structured"] = structured
        if structured is BAD or structured is not None and not structured_ok(structured):
            bad.add("structured")
    for name, value in fields.items():
        if name not in ALIASES:
            out[name] = ref_field(name, value)
            if out[name] is BAD:
                bad.add(name)
    bad |= cross_field(out, bad)
    if bad:
        return None, bad
    for stage in (text_stage(out), vocab_stage(out, vocab, max_logprobs), truncation_stage(out, max_model_len)):
        if stage:
            return None, stage
    return out, None


def cross_field(out: dict[str, Any], bad: set[str]) -> set[str]:
    found = set()
    if not bad & {"min_tokens", "max_tokens"} and out["max_tokens"] is not None \
            and out["min_tokens"] > out["max_tokens"]:
        found.add("min_tokens")
    if not bad & {"detokenize", "stop"} and not out["detokenize"] and out["stop"]:
        found.add("stop")
    if not bad & {"structured", "min_tokens"} and out["structured"] is not None and out["min_tokens"] > 0:
        found.add("structured")
    return found


def surrogates(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def text_stage(out: dict[str, Any]) -> set[str]:
    bad = {"n"} if out["n"] > 1024 else set()
    stop = out["stop"]
    if len(stop) > 256 or any(len(s) > 4096 or surrogates(s) for s in stop):
        bad.add("stop")
    if any(map(surrogates, out["bad_words"])):  # not UTF-8: cannot cross the wire
        bad.add("bad_words")
    structured = out["structured"]
    if structured is not None and any(surrogates(t) for t in (structured.regex, structured.start_after) if t):
        bad.add("structured")  # its texts go to the core too (until 2026-12-07: only the wire refused them)
    return bad


def vocab_stage(out: dict[str, Any], vocab: int, max_logprobs: int) -> set[str]:
    bad = set()
    for name, ids in (("logit_bias", list(out["logit_bias"] or ())), ("allowed_token_ids", out["allowed_token_ids"]
                      or []), ("stop_token_ids", out["stop_token_ids"]),
                      ("bad_words_token_ids", [t for s in out["bad_words_token_ids"] for t in s])):
        if any(t >= vocab for t in ids):
            bad.add(name)
    limit = vocab if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        if out[name] is not None and (vocab if out[name] == -1 else out[name]) > limit:
            bad.add(name)
    banned = {s[0] for s in out["bad_words_token_ids"] if len(s) == 1}
    banned |= set(out["stop_token_ids"]) if out["min_tokens"] else set()
    if out["allowed_token_ids"] and banned >= set(out["allowed_token_ids"]):
        bad.add("allowed_token_ids")
    return bad


def truncation_stage(out: dict[str, Any], max_model_len: int) -> set[str]:
    k = out["truncate_prompt_tokens"]
    keep = max_model_len - 1 if k == -1 else k
    return set() if k is None or 1 <= keep <= max_model_len - 1 else {"truncate_prompt_tokens"}


# ---------------------------------------------------------------- the module: construction to admission
def admit(fields: dict[str, Any], vocab: int, max_logprobs: int, max_model_len: int) -> SamplingParams:
    params = SamplingParams(**copy.deepcopy(fields))
    params.validate()
    check_params_text(params)
    check_params_vocab(params, vocab)
    check_logprobs_limit(params, max_logprobs, vocab)
    check_allowed_tokens(params, [])
    truncation_length(params.truncate_prompt_tokens, max_model_len)
    return params


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1 is not 1.0, nor True, nor DELTA)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k, j) and same(a[k], b[j]) for k, j in zip(a, b))
    return a == b


# ---------------------------------------------------------------- strategies
def numeric(edges: list[Any], valid: st.SearchStrategy, wrong: list[Any], numpy_types: tuple) -> st.SearchStrategy:
    """Bounds and their neighbours, values in range, either as numpy scalars, and wrong values, alike often."""
    as_numpy = st.tuples(st.sampled_from(edges) | valid, st.sampled_from(numpy_types)).map(lambda p: to_numpy(*p))
    return st.one_of(st.sampled_from(edges), valid, as_numpy, st.sampled_from(wrong))


def to_numpy(value: Any, numpy_type: type) -> Any:
    """`value` as a numpy scalar where it fits one (else as is)."""
    return numpy_type(value) if isinstance(value, float) or -2**63 <= value < 2**63 else value


FLOAT_WRONG = [True, False, "0.5", None, math.nan, math.inf, -math.inf, 10**400, -10**400, 2**1100,
               np.bool_(False), [0.5], np.float64("nan")]
INT_WRONG = [True, False, 1.0, "1", np.bool_(True), math.nan, 10**30, -10**30, np.float64(3.0), [1]]


def float_field(name: str) -> st.SearchStrategy:
    lo, hi = FLOAT_RANGES[name]
    edges = [lo, hi, math.nextafter(hi, math.inf), math.nextafter(lo, -math.inf), hi + 1, lo - 1, 0, 1]
    valid = st.floats(lo, hi) | st.floats(lo - 10, hi + 10, allow_nan=False)
    return numeric(edges, valid, FLOAT_WRONG, (np.float64, np.float32))


def int_field(lo: int, hi: int, extra: list[Any]) -> st.SearchStrategy:
    small = st.integers(max(lo, -2**31), min(hi, 2**31 - 1)) if hi - lo > 2**32 else st.integers(lo, hi)
    return numeric([lo, hi, lo - 1, hi + 1], small | st.integers(lo, lo + 40), INT_WRONG + extra, (np.int64,))


VOCABS = (1, 2, 5, 100, 300)
ids = st.one_of(st.integers(0, 6), st.sampled_from([*VOCABS, 99, 299, 2**31, 2**70]), st.just(-1))
wrong_ids = st.sampled_from([True, 1.0, "3", None, np.int64(3)])
id_lists = st.lists(st.one_of(ids, ids, ids, wrong_ids), max_size=6)
words = st.text(st.sampled_from("ab \t\ud800é"), max_size=5) | st.sampled_from(["", " ", "\t", "a\ud800"])
alias_values = st.sampled_from([
    {"regex": "a+"}, {"choice": ["a", "b"]}, {"json": {"type": "object"}}, {"regex": "a", "choice": ["b"]},
    {"nope": 1}, {"choice": ["a"], "backend": "xgrammar"}, {"regex": "a", "backend": "outlines"},
    {"json_object": True}, {"json_object": 1}, {"json_object": True, "json": {}}, {"regex": "b+", "json": None},
    {"regex": "c", "grammar": False, "_backend": "x"}, {"regex": "c", "_backend": "x"}, {"regex": ""}, {}, 5,
    "regex", {"regex": "a\ud800"}])
bias_keys = st.one_of(ids, ids.map(str), st.sampled_from(["abc", "-1", "¹", " 7 ", "+5", 1.0]),
                      ids.filter(lambda i: 0 <= i < 2**63).map(np.int64))
bias_values = st.one_of(st.floats(-100, 100), st.integers(-101, 101), st.sampled_from(
    [True, math.nan, math.inf, "1", 10**400, np.float64(2.5), np.float32(-101)]), st.sampled_from(
    [100, -100.0, 100.5, -100.5, math.nextafter(100, 101)]))

FIELDS: dict[str, st.SearchStrategy] = {
    **{name: float_field(name) for name in FLOAT_RANGES},
    **{name: int_field(lo, hi, []) for name, (lo, hi) in INT_RANGES.items()},
    "seed": int_field(-2**63, 2**63 - 1, [None, -1, 2**63, -2**63 - 1, np.int64(-1), -1.0]),
    "max_tokens": int_field(1, I32, [None]),
    "truncate_prompt_tokens": int_field(1, I32, [None, -1, -2, np.int64(-1)]),
    "logprobs": int_field(-1, I32, [None]),
    "prompt_logprobs": int_field(-1, I32, [None]),
    **{name: st.sampled_from([True, False, True, 1, 0, None, "true", np.bool_(True)]) for name in BOOLS},
    "stop": st.one_of(st.none(), words, st.lists(words, max_size=3), st.sampled_from(
        [["x"] * 256, ["x"] * 257, ["y" * 4096], ["y" * 4097], [1], ("a",)])),
    "stop_token_ids": st.one_of(st.none(), id_lists, st.just((1, 2)), st.just(3)),
    "allowed_token_ids": st.one_of(st.none(), id_lists, st.just((1,))),
    "bad_words": st.one_of(st.none(), st.lists(words, max_size=3), st.sampled_from(
        [["w"] * 128, ["w"] * 129, ["x" * 65536], ["x" * 65537], [b"x"]])),
    "bad_words_token_ids": st.one_of(st.none(), st.lists(id_lists, max_size=3), st.sampled_from(
        [[[5]] * 128, [[5]] * 129, [[1] * 1024], [[1] * 1025], [3]])),
    "logit_bias": st.one_of(st.none(), st.dictionaries(bias_keys, bias_values, max_size=3), st.just([1.0])),
    "output_kind": st.sampled_from([*RequestOutputKind, 0, 1, 2, 3, -1, True, 1.0, "delta", "FINAL_ONLY",
                                    "Cumulative", "sometimes", None]),
    "logprobs_mode": st.sampled_from([None, *MODES, "logits", 5, ["raw_logits"]]),
    "structured": st.one_of(st.none(), alias_values, st.just(StructuredOutputs(regex="x+"))),
    "structured_outputs": st.one_of(st.none(), alias_values),
    "guided_decoding": st.one_of(st.none(), alias_values),
}
small_ids = st.integers(0, 6)
VALID: dict[str, st.SearchStrategy] = {
    **{name: st.floats(lo, hi, exclude_min=name == "top_p") for name, (lo, hi) in FLOAT_RANGES.items()},
    **{name: st.integers(lo, lo + 20) for name, (lo, hi) in INT_RANGES.items()},
    "seed": st.integers(-2**63, 2**63 - 1), "max_tokens": st.none() | st.integers(1, 40),
    "truncate_prompt_tokens": st.sampled_from([None, -1, 1, 63, 64]), "logprobs": st.integers(-1, 25),
    "prompt_logprobs": st.none() | st.integers(-1, 25), **{name: st.booleans() for name in BOOLS},
    "stop": st.lists(st.text("ab\n", min_size=1, max_size=3), max_size=2), "stop_token_ids": st.lists(small_ids),
    "allowed_token_ids": st.lists(small_ids, min_size=1), "bad_words": st.lists(st.text("ab", min_size=1)),
    "bad_words_token_ids": st.lists(st.lists(small_ids, min_size=1, max_size=3), max_size=2),
    "logit_bias": st.dictionaries(small_ids, st.floats(-100, 100), max_size=3),
    "output_kind": st.sampled_from(RequestOutputKind), "logprobs_mode": st.sampled_from([None, *MODES]),
    **{name: st.none() for name in ALIASES},
}


requests = functools.partial(drawn_fields, FIELDS, VALID, 1, 5)
"""One field from its whole pool and a few others valid, or several from their whole pools."""


engines = st.tuples(st.sampled_from(VOCABS), st.sampled_from([-1, 0, 5, 20, 1000]), st.sampled_from([1, 2, 64, 4096]))


# ---------------------------------------------------------------- the property
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), engines)
@example({"temperature": 10**400}, (100, 20, 64))  # a huge int is out of range, not an OverflowError
@example({"logit_bias": {"3": -10**400}}, (100, 20, 64))
@example({"seed": np.int64(-1)}, (100, 20, 64))  # numpy's -1 is vLLM's "no seed" too
@example({"top_p": np.float32(1e-50)}, (100, 20, 64))  # float32 rounds it to 0: out of (0, 1]
@example({"min_tokens": 5, "max_tokens": 4}, (100, 20, 64))
@example({"min_tokens": 4, "max_tokens": 4}, (100, 20, 64))
@example({"stop_token_ids": [100]}, (100, 20, 64))  # ids must be below the vocabulary size
@example({"stop_token_ids": [3, -1]}, (100, 20, 64))  # negative ids
@example({"logit_bias": {-1: 0.0}}, (100, 20, 64))
@example({"bad_words": ["a", " "]}, (100, 20, 64))  # a blank word bans nothing
@example({"min_tokens": 1, "structured_outputs": {"regex": "a"}}, (100, 20, 64))
@example({"detokenize": False, "stop": "x"}, (100, 20, 64))
@example({"structured": {"regex": "a"}, "guided_decoding": {"regex": "b"}}, (100, 20, 64))
@example({"stop_token_ids": [7, 3, 7], "allowed_token_ids": [5, 5, 2]}, (100, 20, 64))
@example({"allowed_token_ids": [4], "bad_words_token_ids": [[4]]}, (100, 20, 64))
@example({"allowed_token_ids": [4], "bad_words_token_ids": [[4, 5]]}, (100, 20, 64))  # 4 may follow other tokens
@example({"allowed_token_ids": [4, 9], "stop_token_ids": [9, 4], "min_tokens": 1}, (100, 20, 64))
@example({"logprobs": -1}, (100, 20, 64))
@example({"logprobs": -1, "prompt_logprobs": 100}, (100, -1, 64))
@example({"truncate_prompt_tokens": -1}, (100, 20, 1))
@example({"truncate_prompt_tokens": 63}, (100, 20, 64))
@example({"logit_bias": {"99": 1, 99: 2.0}}, (100, 20, 64))
@example({"logit_bias": {1: 100.5}}, (100, 20, 64))
@example({"logit_bias": {"abc": 1.0}}, (100, 20, 64))  # not a token id (and no ValueError from int())
@example({"logit_bias": {np.int64(4): np.float64(2.5)}}, (100, 20, 64))
@example({"output_kind": True}, (100, 20, 64))  # a bool is not RequestOutputKind.DELTA
@example({"output_kind": "final_only", "n": 1024}, (100, 20, 64))
@example({"bad_words_token_ids": [[99]]}, (99, 20, 64))
@example({"bad_words": ["a\ud800"]}, (100, 20, 64))  # not UTF-8: refused by name, not by the tokenizer or wire
@example({"ignore_eos": np.True_}, (100, 20, 64))
@example({"structured": StructuredOutputs(regex="x", start_after="\udc00")}, (100, 20, 64))  # a bool field takes Python's bool only (numpy 2's np.bool)
def test_admission_matches_the_reference(fields: dict[str, Any], engine: tuple[int, int, int]) -> None:
    expected, may_name = reference(fields, *engine)
    params = admitted(lambda: admit(fields, *engine), expected, may_name, same)
    if params is None:
        return
    before = copy.deepcopy(params)
    params.validate()
    assert all(same(getattr(params, f), getattr(before, f)) for f in SamplingParams.__struct_fields__)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
