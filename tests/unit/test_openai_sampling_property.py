"""Property test: an OpenAI request body plus the model's generation config become the documented `SamplingParams`.

The whole host path is exercised: a drawn ``generation_config.json`` (in the model folder, or in a
``--generation-config`` folder; missing; a GGUF file; or turned off by ``vllm``) and a drawn
``override_generation_config`` go through `EngineConfig.create`, `read_generation_config`, `sampling_fields_of`,
`default_sampling_fields` and `with_max_tokens_cap` (what asyncllm/engine/prepare.py and the server's
``_sampling_defaults`` do); a drawn completions or chat body is decoded by `decode_request` and mapped by
`completion_params` / `chat_params`. A plain reference written from docs/sampling.md ("Default sampling
parameters", the parameter table) and docs/integrations/openai-server.md ("Parameters", vLLM's ``get_max_tokens``
and ``to_sampling_params``) predicts every field, or the set of fields one of which the 400 must name:

* the six generation-config fields default only what a request leaves unset (null or left out); an explicit value,
  even the neutral one (``temperature: 1.0``), wins; ``vllm`` reads no file, a folder reads its own file, and an
  override's null removes the file's default;
* max_tokens: chat's ``max_completion_tokens`` before ``max_tokens``; completions default to 16; an unset one takes
  ``max_new_tokens``; ``override_generation_config``'s (a folder's file's, overrides included) caps every value;
  the server's ``--max-tokens-limit`` is the default of the rest and a bound (a sent value past it: a 400; a
  default past it is cut to it);
* seed -1, ``stop`` as a string, duplicate ids, ``logit_bias`` clamping and string keys, null penalties,
  completions' ``logprobs`` vs chat's ``logprobs`` / ``top_logprobs``, echo's prompt logprobs and ``max_tokens`` 0,
  ``best_of``, ``response_format``, and the refusals that follow from valid fields put together.

Malformed bodies are tests/integrations/test_openai_fuzz_property.py's; tests/unit/test_generation_defaults.py
holds the file reading's own cases. ``PROP_EXAMPLES`` raises the number of draws (mutation runs).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm import EngineConfig
from asyncllm.engine.defaults import default_sampling_fields
from asyncllm.errors import InvalidRequestError
from asyncllm.generation_config import read_generation_config, sampling_fields_of
from asyncllm.integrations.openai_protocol import ChatCompletionRequest, CompletionRequest, ServerLimits, decode_request
from asyncllm.integrations.openai_sampling import chat_params, completion_params, with_max_tokens_cap

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 60,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---------------------------------------------------------------------------------------------------- the reference

FILE_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""docs/sampling.md: generation_config.json's six keys and the SamplingParams field each defaults."""
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
"""The parameter table's defaults, for a field neither the request nor the generation config sets."""
MODEL_FOLDER = ("auto", "vllm", "missing", "gguf")
"""Sources that read (or, ``vllm``, ignore) the model folder's file; ``folder`` is a --generation-config folder."""


class Case:
    """One drawn situation: the generation config's source and files, the overrides, the server's limits, a body."""

    def __init__(self, source: str, model_file: dict, folder_file: dict, overrides: dict | None,
                 limit: int | None, max_n: int, chat: bool, body: dict) -> None:
        self.source, self.model_file, self.folder_file, self.overrides = source, model_file, folder_file, overrides
        self.limit, self.max_n, self.chat, self.body = limit, max_n, chat, body

    def __repr__(self) -> str:
        return f"Case({self.__dict__!r})"


def ref_defaults(case: Case) -> tuple[dict[str, Any], int | None]:
    """(the fields the generation config defaults, the cap on every max_tokens) as the docs describe them."""
    file = {"auto": case.model_file, "folder": case.folder_file}.get(case.source, {})
    fields = {FILE_KEYS[key]: value for key, value in file.items() if key in FILE_KEYS}
    overrides = {FILE_KEYS.get(key, key): value for key, value in (case.overrides or {}).items()}
    fields = {key: value for key, value in {**fields, **overrides}.items() if value is not None}
    cap = fields.get("max_tokens") if case.source == "folder" else overrides.get("max_tokens")
    return fields, cap


def ref_max_tokens(requested: int | None, defaults: dict, cap: int | None, limit: int | None) -> int | None | str:
    """vLLM's get_max_tokens as openai-server.md words it; "max_tokens": the server's limit refuses it (a value the
    request sent: a default over the limit is cut to it)."""
    value = defaults.get("max_tokens") if requested is None else requested
    if cap is not None:
        value = cap if value is None else min(value, cap)
    if limit is not None and (value is None or (requested is None and value > limit)):
        return limit
    return "max_tokens" if limit is not None and value > limit else value


def ref_requested(case: Case) -> tuple[int | None, bool]:
    """(the max_tokens the body asks for, echo with max_tokens 0: the prompt alone, one token run and dropped)."""
    body = case.body
    if case.chat:
        given = body.get("max_completion_tokens")
        return (given if given is not None else body.get("max_tokens")), False
    requested = body.get("max_tokens", 16)
    echo_only = bool(body.get("echo")) and requested == 0
    return (1 if echo_only else requested), echo_only


def ref_logprobs(case: Case, errors: set[str]) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs): completions' count, chat's bool with top_logprobs; echo adds the prompt's."""
    body = case.body
    prompt = _count(body.get("prompt_logprobs"))
    if case.chat:
        top = _count(body.get("top_logprobs"))
        if top and not body.get("logprobs"):
            errors.add("top_logprobs")
        return ((top or 0) if body.get("logprobs") else None), prompt
    logprobs = _count(body.get("logprobs"))
    if body.get("echo") and logprobs is not None:
        prompt = -1 if -1 in (logprobs, prompt) else max(logprobs, prompt or 0)
    return logprobs, prompt


def _count(value: Any) -> int | None:
    """A logprob count as the server reads it: true is 1, false 0."""
    return int(value) if isinstance(value, bool) else value


def _distinct(ids: list[int] | None) -> list[int] | None:
    return None if ids is None else list(dict.fromkeys(ids))


def ref_body_fields(body: dict) -> dict[str, Any]:
    """The fields a body sets one for one (null: the documented default)."""
    stop = body.get("stop")
    bias = body.get("logit_bias")
    seed = body.get("seed")
    return {
        "n": body.get("n") or 1, "seed": None if seed == -1 else seed,
        "stop": [] if stop is None else [stop] if isinstance(stop, str) else stop,
        "stop_token_ids": _distinct(body.get("stop_token_ids")) or [],
        "allowed_token_ids": _distinct(body.get("allowed_token_ids")),
        "bad_words": body.get("bad_words") or [], "min_tokens": body.get("min_tokens", 0),
        "presence_penalty": body.get("presence_penalty") or 0.0,
        "frequency_penalty": body.get("frequency_penalty") or 0.0,
        "logit_bias": None if bias is None else {int(k): min(100.0, max(-100.0, v)) for k, v in bias.items()},
        "truncate_prompt_tokens": body.get("truncate_prompt_tokens"),
        **{name: body.get(name, default) for name, default in (
            ("ignore_eos", False), ("skip_special_tokens", True), ("spaces_between_special_tokens", True),
            ("include_stop_str_in_output", False))},
    }


def reference(case: Case) -> tuple[dict[str, Any], set[str]]:
    """(the expected SamplingParams fields, the fields a 400 may name: empty when the request is accepted)."""
    body, errors = case.body, set()
    defaults, cap = ref_defaults(case)
    requested, echo_only = ref_requested(case)
    max_tokens = ref_max_tokens(requested, defaults, cap, case.limit)
    logprobs, prompt_logprobs = ref_logprobs(case, errors)
    expected = {**ref_body_fields(body), "max_tokens": max_tokens, "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs,
                **{name: body[name] if body.get(name) is not None else defaults.get(name, fallback)
                   for name, fallback in NEUTRAL.items()}}
    expected["json_object"] = (body.get("response_format") or {}).get("type") == "json_object"
    _refusals(case, expected, echo_only, errors)
    return expected, errors


def _refusals(case: Case, expected: dict, echo_only: bool, errors: set[str]) -> None:
    """The 400s valid fields make together (docs: vLLM's checks, SamplingParams' ranges, the server's limits)."""
    body, max_tokens = case.body, expected["max_tokens"]
    if max_tokens == "max_tokens" or (max_tokens is not None and max_tokens < 1):
        errors.add("max_tokens")
    elif echo_only and body.get("min_tokens"):
        errors.add("min_tokens")
    elif max_tokens is not None and expected["min_tokens"] > max_tokens:
        errors.add("min_tokens")
    if body.get("best_of") is not None and body["best_of"] != expected["n"]:
        errors.add("best_of")
    prompt = _count(body.get("prompt_logprobs"))
    if body.get("stream") and prompt is not None and (prompt > 0 or prompt == -1):
        errors.add("prompt_logprobs")
    if expected["json_object"] and expected["min_tokens"]:  # openai-server.md: the grammar decides the end
        errors.add("response_format")
    if body.get("length_penalty", 1.0) != 1.0:
        errors.add("length_penalty")
    if expected["n"] > case.max_n:
        errors.add("n")


# ------------------------------------------------------------------------------------------- the code under test


def _write(folder: str, keys: dict | None) -> None:
    os.makedirs(folder, exist_ok=True)
    if keys is not None:
        with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(keys, f)


def engine_defaults(case: Case, root: str) -> dict[str, Any]:
    """The server's sampling defaults, read as the engine and the server read them (prepare.py, openai_server)."""
    model, folder = os.path.join(root, "model"), os.path.join(root, "gc")
    _write(model, None if case.source == "missing" else case.model_file)
    _write(folder, case.folder_file)
    if case.source == "gguf":
        model = os.path.join(root, "model.gguf")
        open(model, "w").close()
    name = {"folder": folder, "vllm": "vllm"}.get(case.source, "auto")
    config = EngineConfig.create(model, generation_config=name, override_generation_config=case.overrides)
    generation = read_generation_config(config.generation_config, model)
    fields = default_sampling_fields(sampling_fields_of(config.generation_config, generation),
                                     config.override_generation_config)
    return with_max_tokens_cap(fields, config)


def actual(case: Case) -> dict[str, Any] | InvalidRequestError:
    """The SamplingParams fields the module builds, or the 400 it raises."""
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        defaults = engine_defaults(case, root)
    limits = ServerLimits(max_tokens=case.limit, max_n=case.max_n)
    kind = ChatCompletionRequest if case.chat else CompletionRequest
    req = decode_request(json.dumps(case.body).encode(), kind)
    try:
        params = (chat_params if case.chat else completion_params)(req, limits, defaults=defaults)
    except InvalidRequestError as exc:
        return exc
    fields = {name: getattr(params, name) for name in (*NEUTRAL, *ref_body_fields({}), "max_tokens", "logprobs",
                                                        "prompt_logprobs")}
    fields["json_object"] = params.structured is not None and params.structured.json == {"type": "object"}
    return fields


# --------------------------------------------------------------------------------------------------- the strategies

def _opt(strategy: st.SearchStrategy, null: bool = True) -> st.SearchStrategy:
    """A field left out (None: dropped from the body), sent null, or a value."""
    options = [st.just("<omit>"), strategy] + ([st.none()] if null else [])
    return st.one_of(*options)


SAMPLING_VALUES = {
    "temperature": st.sampled_from([0.0, 1.0, 0.6]) | st.floats(0.0, 2.0),
    "top_p": st.sampled_from([1.0, 0.95]) | st.floats(0.01, 1.0),
    "top_k": st.sampled_from([-1, 0, 20]) | st.integers(1, 100),
    "min_p": st.sampled_from([0.0, 0.05]) | st.floats(0.0, 1.0),
    "repetition_penalty": st.sampled_from([1.0, 1.1]) | st.floats(0.5, 2.0),
}
FILE_VALUES = {**SAMPLING_VALUES, "max_new_tokens": st.integers(1, 64)}
TOKEN_IDS = st.lists(st.integers(0, 9), min_size=1, max_size=5)
COMMON = {
    "seed": st.sampled_from([-1, 0, 2**63 - 1, -(2**63)]) | st.integers(-5, 10**6),
    "stop": st.sampled_from(["\n", "###"]) | st.lists(st.sampled_from(["a", "END", "\n\n"]), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 9), max_size=5), "allowed_token_ids": TOKEN_IDS,
    "bad_words": st.lists(st.sampled_from(["foo", "bar baz"]), max_size=2),
    "logit_bias": st.dictionaries(st.integers(0, 50).map(str), st.floats(-300.0, 300.0), max_size=3),
    "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0),
    "truncate_prompt_tokens": st.sampled_from([-1, 1, 100]), "prompt_logprobs": st.sampled_from([-1, 0, 2, True]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
NOT_NULL = {  # fields vLLM declares not nullable: a value or left out
    "min_tokens": st.sampled_from([0, 1]) | st.integers(0, 40), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(), "length_penalty": st.sampled_from([1.0, 1.0, 1.0, 0.5]),
}
COUNT = st.sampled_from([8, 100]) | st.integers(1, 120)  # the limits drawn below, exactly
COMPLETION = {"max_tokens": st.sampled_from([0, 16, 16]) | COUNT, "logprobs": st.sampled_from([-1, 0, 1, 3, False]),
              "echo": st.booleans(), "best_of": st.integers(1, 4)}
CHAT = {"max_tokens": COUNT, "max_completion_tokens": COUNT, "logprobs": st.sampled_from([True, True, False]),
        "top_logprobs": st.sampled_from([-1, 0, 0, 2, True])}


@st.composite
def bodies(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    fields = {name: _opt(value) for name, value in {**SAMPLING_VALUES, **COMMON}.items()}
    fields.update({name: _opt(value, null=False) for name, value in NOT_NULL.items()})
    fields.update({name: _opt(value) for name, value in (CHAT if chat else COMPLETION).items()})
    fields["n"] = _opt(st.integers(1, 4), null=chat)
    body = {name: draw(strategy) for name, strategy in fields.items()}
    body = {name: value for name, value in body.items() if value != "<omit>"}
    if chat:
        return {"messages": [{"role": "user", "content": "hi"}], **body}
    return {"prompt": "hi", **body}


def _file(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(FILE_VALUES)), unique=True, max_size=6))
    file = {key: draw(FILE_VALUES[key] | st.none()) for key in keys}
    if draw(st.booleans()):  # keys the defaults do not read
        file.update(do_sample=draw(st.booleans()), eos_token_id=2, transformers_version="4.50.0")
    return file


@st.composite
def cases(draw: st.DrawFn) -> Case:
    source = draw(st.sampled_from(["auto", "auto", "folder", "vllm", "missing", "gguf"]))
    overrides = None
    if draw(st.booleans()):
        keys = draw(st.lists(st.sampled_from([*sorted(FILE_VALUES), "max_tokens"]), unique=True, max_size=4))
        keys = [key for key in keys if not (key == "max_tokens" and "max_new_tokens" in keys)]
        overrides = {key: draw(FILE_VALUES.get(key, FILE_VALUES["max_new_tokens"]) | st.none()) for key in keys}
    chat = draw(st.booleans())
    limit = draw(st.sampled_from([None, None, None, None, 8, 100]))
    return Case(source, _file(draw), _file(draw), overrides, limit, draw(st.sampled_from([128, 128, 2])), chat,
                draw(bodies(chat)))


# -------------------------------------------------------------------------------------------------------- the tests

QWEN = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 32}


def _check(case: Case) -> None:
    expected, errors = reference(case)
    got = actual(case)
    if errors or isinstance(got, InvalidRequestError):
        assert isinstance(got, InvalidRequestError), f"accepted, expected a 400 naming one of {errors}: {got}"
        assert got.field in errors, f"400 naming {got.field!r} ({got.message}); expected one of {errors}"
        return
    assert got == expected


@SETTINGS
@given(cases())
@example(Case("auto", QWEN, {}, None, None, 128, True, {"messages": [], "temperature": 1.0, "top_k": 0}))
@example(Case("auto", QWEN, {}, None, None, 128, True, {"messages": [], "temperature": None, "top_p": None}))
@example(Case("auto", QWEN, {}, None, None, 128, False, {"prompt": "hi", "max_tokens": None}))
@example(Case("auto", QWEN, {}, {"max_new_tokens": 4}, None, 128, False, {"prompt": "hi", "min_tokens": 8}))
@example(Case("auto", QWEN, {}, {"max_new_tokens": None, "top_k": None}, None, 128, True, {"messages": []}))
@example(Case("folder", QWEN, {"max_new_tokens": 8, "top_p": 0.5}, None, None, 128, True,
              {"messages": [], "max_tokens": 100}))
@example(Case("vllm", QWEN, {}, {"temperature": 0.2}, 100, 128, True, {"messages": []}))
@example(Case("auto", QWEN, {}, None, 8, 128, True, {"messages": [], "max_completion_tokens": 4,
                                                      "max_tokens": 50}))
@example(Case("auto", {}, {}, None, None, 128, False, {"prompt": "hi", "echo": True, "max_tokens": 0,
                                                       "logprobs": 2, "prompt_logprobs": 0}))
@example(Case("auto", {}, {}, None, None, 128, False, {"prompt": "hi", "echo": True, "logprobs": 1,
                                                       "prompt_logprobs": 2}))
@example(Case("auto", {}, {}, None, None, 128, False, {"prompt": "hi", "echo": True, "max_tokens": 0,
                                                       "min_tokens": 1}))
@example(Case("auto", {}, {}, None, 8, 128, True, {"messages": [], "max_tokens": 8}))
@example(Case("auto", QWEN, {}, None, 8, 128, True, {"messages": []}))  # the model's 32 cut to the limit: no 400
@example(Case("auto", {}, {}, {"max_new_tokens": 50}, 8, 128, False, {"prompt": "hi", "max_tokens": None}))
@example(Case("auto", {}, {}, None, None, 128, True, {"messages": [], "stream": True, "prompt_logprobs": -1}))
@example(Case("auto", {}, {}, None, None, 128, False, {"prompt": "hi", "echo": True, "logprobs": 0,
                                                       "prompt_logprobs": -1, "best_of": 1}))
@example(Case("auto", {}, {}, None, None, 128, True, {"messages": [], "logprobs": False, "top_logprobs": 0,
                                                      "logit_bias": {"3": -1000.0, "4": 250.0}, "seed": -1}))
def test_a_body_and_the_generation_config_make_the_documented_params(case: Case) -> None:
    _check(case)


@pytest.mark.parametrize("chat", [False, True])
def test_an_explicit_neutral_value_beats_the_models_default(chat: bool) -> None:
    """vLLM's to_sampling_params: only an unset field takes generation_config.json's value."""
    body = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 5}
    body.update({"messages": []} if chat else {"prompt": "hi"})
    file = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.3}
    got = actual(Case("auto", file, {}, None, None, 128, chat, body))
    assert {key: got[key] for key in (*NEUTRAL, "max_tokens")} == {**NEUTRAL, "top_k": -1, "max_tokens": 5}
