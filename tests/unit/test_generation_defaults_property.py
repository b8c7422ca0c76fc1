"""Property test: a model's generation_config.json becomes the default `SamplingParams` as vLLM's do.

Drawn: the engine's ``generation_config`` (``auto`` reading the model folder's file, ``vllm``, a folder holding its
own file, a folder without one, or ``auto`` for a model folder without the file, whose config.json's generation
attributes stand in); each file's keys (each of the six sampling keys absent, null, a value or, now and then, one
`SamplingParams` refuses; edge values: temperature 0, top_k 0 and -1, integral numbers, the bounds; ``do_sample``,
``eos_token_id`` as an int or a list, keys nobody reads); config.json's ``eos_token_id`` and generation attributes;
``override_generation_config`` (the six keys, ``max_tokens``, nulls, now and then a key it refuses); whether the
tokenizer loads; a request's explicit `SamplingParams` fields (or none) and ``asyncllm generate``'s flags.

What runs: the host's whole preparation, `prepare` (asyncllm/engine/prepare.py: `read_generation_config`,
`from_model_config`, `sampling_fields_of`, `default_sampling_fields`, `eos_token_ids`) on a copy of the tiny Llama
checkpoint, no engine; then `EngineRequests.generate` (with ``start`` and ``stream`` stubbed) for the params a
request runs with, and the CLI's ``_generate`` (with `AsyncEngine` stubbed) for its per-flag merge.

The model is vLLM's ``ModelConfig.get_diff_sampling_param`` as docs/sampling.md and docs/cli.md word it: the file's
keys (``vllm``: none; a model folder without the file: config.json's, as transformers 5 loads it, which keeps
``min_p`` and ``max_new_tokens`` of the six and drops the others with its legacy generation parameters), updated by
the overrides (``max_tokens`` taken as ``max_new_tokens``: asyncllm's documented alias), the six non-null ones kept
(``max_new_tokens`` as ``max_tokens``); ``do_sample`` and other keys never read. A request without `SamplingParams`
runs with those over `SamplingParams`' defaults, one with its own runs with exactly them (vLLM's ``LLM.generate``);
the CLI takes its flags, then the defaults, then its fallbacks (max_tokens 64, temperature 0.7). The EOS ids are the
tokenizer's (config.json's without one), then the file's ``eos_token_id`` (``vllm`` included). asyncllm's documented
refusals where vLLM would go on: an override key vLLM ignores, both ``max_new_tokens`` and ``max_tokens``, a folder
without the file, and a file value `SamplingParams` refuses (refused at start, ``generation_config`` named).

tests/unit/test_generation_defaults.py holds plain cases, tests/unit/test_openai_sampling_property.py the server's
per-field defaults. ``PROP_EXAMPLES`` raises the number of draws (mutation runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from types import SimpleNamespace
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import asyncllm
from asyncllm import EngineConfig
from asyncllm.engine.engine_requests import EngineRequests
from asyncllm.errors import ConfigError

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "50"))

FILE_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""generation_config.json's six sampling keys and the `SamplingParams` field each defaults (vLLM's)."""
KEPT_FROM_CONFIG_JSON = ("min_p", "max_new_tokens")
"""The six that transformers 5's config loading keeps from a config.json (it pops the legacy generation
parameters: temperature, top_k, top_p, repetition_penalty, do_sample), so `from_model_config` can read them."""
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 16,
           "seed": None}
"""`SamplingParams`' own defaults (docs/sampling.md's table), for a field nothing sets."""
CLI_FALLBACKS = {"max_tokens": 64, "temperature": 0.7}
"""docs/cli.md: ``generate``'s ``--max-tokens`` and ``--temperature`` where neither flag nor model sets one."""
TOKENIZER_EOS = 1
"""The tiny Llama tokenizer's EOS id."""
BAD = {"temperature": (-0.5, 100.5), "top_p": (0.0, 1.5), "top_k": (-2,), "min_p": (-0.1, 1.5),
       "repetition_penalty": (0.0, -1.0), "max_tokens": ()}
"""Values `SamplingParams` refuses (a file holding one is refused at start); none of them is drawn from `VALUES`."""

# ---------------------------------------------------------------------------------------------------- the reference


class Case:
    """One drawn situation: the source, the files, the overrides, the tokenizer, a request and the CLI's flags."""

    def __init__(self, source: str, model_file: dict, folder_file: dict, config_json: dict, overrides: dict | None,
                 skip_tokenizer: bool, request: dict | None, flags: dict) -> None:
        self.source, self.model_file, self.folder_file, self.config_json = source, model_file, folder_file, config_json
        self.overrides, self.skip_tokenizer, self.request, self.flags = overrides, skip_tokenizer, request, flags

    def __repr__(self) -> str:
        return f"Case({self.__dict__!r})"


def ref_generation(case: Case) -> dict[str, Any]:
    """The keys the engine's generation config holds (vLLM's ``try_get_generation_config``): the file the field
    names, or config.json's generation attributes for a model folder without one."""
    if case.source == "missing":
        return {key: value for key, value in case.config_json.items()
                if key in KEPT_FROM_CONFIG_JSON + ("eos_token_id",) and value is not None}
    return case.folder_file if case.source == "folder" else case.model_file


def ref_defaults(case: Case) -> dict[str, Any] | str:
    """vLLM's ``get_diff_sampling_param`` (the fields the defaults set), or the field a `ConfigError` names."""
    overrides = case.overrides or {}
    if set(overrides) - {*FILE_KEYS, "max_tokens"} or {"max_tokens", "max_new_tokens"} <= set(overrides):
        return "override_generation_config"
    if case.source == "empty":
        return "generation_config"
    config = {} if case.source == "vllm" else dict(ref_generation(case))
    config.update({"max_new_tokens" if key == "max_tokens" else key: value for key, value in overrides.items()})
    fields = {field: config[key] for key, field in FILE_KEYS.items() if config.get(key) is not None}
    if any(value in BAD[field] for field, value in fields.items()):
        return "generation_config"
    return fields


def ref_eos(case: Case) -> list[int]:
    """The tokenizer's EOS (config.json's without a tokenizer), then the generation config's, each id once."""
    first = case.config_json["eos_token_id"] if case.skip_tokenizer else TOKENIZER_EOS
    extra = ref_generation(case).get("eos_token_id")
    ids = [*_listify(first), *_listify(extra)]
    return [token for i, token in enumerate(ids) if isinstance(token, int) and token not in ids[:i]]


def _listify(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def ref_params(defaults: dict[str, Any], request: dict | None) -> dict[str, Any]:
    """The fields a request runs with: the defaults without `SamplingParams`, else exactly its own (seed -1:
    vLLM's no seed)."""
    chosen = defaults if request is None else {**request, "seed": None if request.get("seed") == -1 else
                                               request.get("seed")}
    return {field: chosen.get(field, neutral) for field, neutral in NEUTRAL.items()}


def ref_cli(defaults: dict[str, Any], flags: dict) -> dict[str, Any]:
    """``asyncllm generate``'s fields: its flags, then the model's defaults, then its fallbacks."""
    chosen = {**CLI_FALLBACKS, **defaults, **{name: value for name, value in flags.items() if value is not None}}
    return {field: chosen.get(field, neutral) for field, neutral in NEUTRAL.items()}


# ------------------------------------------------------------------------------------------- the code under test


def _write(folder: str, name: str, keys: dict | None) -> None:
    os.makedirs(folder, exist_ok=True)
    if keys is not None:
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(keys, f)


def prepared(case: Case, checkpoint: str, root: str) -> Any:
    """`prepare`'s result for the case's files and fields (a `ConfigError` raised)."""
    from asyncllm.engine.prepare import prepare

    model, folder = os.path.join(root, "model"), os.path.join(root, "gc")
    os.makedirs(model)
    for name in os.listdir(checkpoint):
        if name not in ("config.json", "generation_config.json"):
            os.symlink(os.path.join(checkpoint, name), os.path.join(model, name))
    with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
        _write(model, "config.json", {**json.load(f), **case.config_json})
    _write(model, "generation_config.json", None if case.source == "missing" else case.model_file)
    _write(folder, "generation_config.json", case.folder_file if case.source == "folder" else None)
    name = {"folder": folder, "empty": folder, "vllm": "vllm"}.get(case.source, "auto")
    return prepare(EngineConfig.create(model, generation_config=name, override_generation_config=case.overrides,
                                       skip_tokenizer_init=case.skip_tokenizer))


class _Captured(Exception):
    """What a stubbed ``stream`` was handed."""

    def __init__(self, params: Any) -> None:
        super().__init__()
        self.params = params


class _Host(EngineRequests):
    """`AsyncEngine`'s request methods over the prepared defaults, without an engine."""

    def __init__(self, defaults: dict[str, Any]) -> None:
        self._default_sampling = defaults

    async def start(self) -> None:
        pass

    def stream(self, prompt: Any, params: Any, **options: Any) -> Any:
        raise _Captured(params)


class _CliEngine(_Host):
    """What ``asyncllm generate`` drives: `AsyncEngine.from_config` as an async context manager."""

    defaults: dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: Any) -> "_CliEngine":
        return cls(cls.defaults)

    async def __aenter__(self) -> "_CliEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None


def _run(coroutine: Any) -> Any:
    """The `SamplingParams` a stubbed ``stream`` got."""
    try:
        asyncio.run(coroutine)
    except _Captured as captured:
        return captured.params
    raise AssertionError("stream was never called")


def _fields(params: Any) -> dict[str, Any]:
    return {field: getattr(params, field) for field in NEUTRAL}


def request_params(defaults: dict[str, Any], request: dict | None) -> dict[str, Any]:
    """The fields `generate` hands on for a request with these explicit fields (None: no `SamplingParams`)."""
    from asyncllm import SamplingParams

    params = None if request is None else SamplingParams(**request)
    return _fields(_run(_Host(defaults).generate("hi", params)))


def cli_params(defaults: dict[str, Any], flags: dict) -> dict[str, Any]:
    """The fields ``asyncllm generate`` streams with for these flags."""
    from asyncllm import cli

    _CliEngine.defaults = defaults
    args = SimpleNamespace(prompt="", **flags)
    with mock.patch.object(asyncllm, "AsyncEngine", _CliEngine):
        return _fields(_run(cli._generate(args, None, None)))


# --------------------------------------------------------------------------------------------------- the strategies

VALUES = {
    "temperature": st.sampled_from([0, 0.0, 1, 1.0, 0.6, 100.0]) | st.floats(0.0, 2.0),
    "top_p": st.sampled_from([1, 1.0, 0.95, 1e-9]) | st.floats(0.0, 1.0, exclude_min=True),
    "top_k": st.sampled_from([-1, 0, 1, 20, 50, 2**31 - 1]) | st.integers(-1, 200),
    "min_p": st.sampled_from([0, 0.0, 1.0, 0.05]) | st.floats(0.0, 1.0),
    "repetition_penalty": st.sampled_from([1, 1.0, 1.3, 2.0**-31, 2.0**31]) | st.floats(0.5, 2.0),
    "max_new_tokens": st.sampled_from([1, 512, 2**31 - 1]) | st.integers(1, 4096),
}
EOS = st.integers(0, 20) | st.lists(st.integers(0, 20), max_size=4) | st.none()
UNREAD = {"do_sample": st.booleans(), "bos_token_id": st.integers(0, 3), "transformers_version": st.just("4.51.3"),
          "cache_implementation": st.just("hybrid"), "pad_token_id": st.integers(0, 3)}


@st.composite
def files(draw: st.DrawFn, bad: bool = True) -> dict[str, Any]:
    """A generation_config.json (or config.json's generation attributes): sampling keys and keys nobody reads."""
    keys = draw(st.lists(st.sampled_from(sorted(VALUES)), unique=True, max_size=6))
    file: dict[str, Any] = {key: draw(st.one_of(VALUES[key], VALUES[key], VALUES[key], st.none())) for key in keys}
    refused = [key for key in keys if BAD[FILE_KEYS[key]]]
    if bad and refused and draw(st.integers(0, 3)) == 0:  # now and then one value SamplingParams refuses
        key = draw(st.sampled_from(refused))
        file[key] = draw(st.sampled_from(BAD[FILE_KEYS[key]]))
    for key in draw(st.lists(st.sampled_from(sorted(UNREAD)), unique=True, max_size=3)):
        file[key] = draw(UNREAD[key])
    if draw(st.booleans()):
        file["eos_token_id"] = draw(EOS)
    return file


@st.composite
def overrides(draw: st.DrawFn) -> dict[str, Any] | None:
    if draw(st.booleans()):
        return None
    names = [*sorted(VALUES), "max_tokens"] * 4 + ["do_sample", "seed"]
    keys = draw(st.lists(st.sampled_from(names), unique=True, max_size=4))
    if "max_tokens" in keys and "max_new_tokens" in keys and draw(st.integers(0, 3)):
        keys.remove("max_tokens")
    values = {**VALUES, "max_tokens": VALUES["max_new_tokens"], "do_sample": st.just(False), "seed": st.just(1)}
    return {key: draw(values[key] | st.none()) for key in keys}


REQUEST_VALUES = {**{FILE_KEYS[key]: value for key, value in VALUES.items()},
                  "seed": st.sampled_from([-1, 0, 7]) | st.none()}


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any] | None:
    if draw(st.booleans()):
        return None
    keys = draw(st.lists(st.sampled_from(sorted(REQUEST_VALUES)), unique=True, max_size=4))
    return {key: draw(REQUEST_VALUES[key]) for key in keys}


@st.composite
def cases(draw: st.DrawFn) -> Case:
    source = draw(st.sampled_from(["auto", "folder", "missing", "vllm", "auto", "folder", "missing", "empty"]))
    config_json = {**draw(files(bad=False)), "eos_token_id": draw(st.integers(0, 20) | st.lists(
        st.integers(0, 20), min_size=1, max_size=3))}
    flags = {name: draw(st.none() | value) for name, value in (
        ("max_tokens", VALUES["max_new_tokens"]), ("temperature", VALUES["temperature"]),
        ("seed", st.integers(0, 9)))}
    return Case(source, draw(files()), draw(files()), config_json, draw(overrides()), draw(st.booleans()),
                draw(requests()), flags)


# -------------------------------------------------------------------------------------------------------- the tests

QWEN = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 512, "do_sample": True,
        "eos_token_id": [151645, 151643], "bos_token_id": 151643, "pad_token_id": 151643}
NO_FLAGS = {"max_tokens": None, "temperature": None, "seed": None}


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@given(case=cases())
@example(case=Case("auto", QWEN, {}, {"eos_token_id": 1}, None, False, None, NO_FLAGS))
@example(case=Case("auto", {"do_sample": False, "temperature": 0.7, "top_k": -1, "min_p": 0}, {},
                   {"eos_token_id": 1}, {"max_tokens": 9, "top_k": None}, False, {"top_p": 0.5}, NO_FLAGS))
@example(case=Case("vllm", {"temperature": -0.5, "eos_token_id": [13, 1, 13]}, {}, {"eos_token_id": [1, 2]},
                   {"top_k": 0}, True, None, {"max_tokens": None, "temperature": 0.0, "seed": None}))
@example(case=Case("folder", QWEN, {"top_p": 0.5, "eos_token_id": 11}, {"eos_token_id": 1}, None, False, None,
                   {"max_tokens": 3, "temperature": None, "seed": 4}))
@example(case=Case("missing", {}, {}, {"eos_token_id": [1, 13], "max_new_tokens": 7, "min_p": 0.1, "top_k": 5,
                                       "temperature": 0.3}, None, True, None, NO_FLAGS))
@example(case=Case("auto", {"temperature": 100.5}, {}, {"eos_token_id": 1}, {"temperature": None}, False, None,
                   NO_FLAGS))
@example(case=Case("auto", {}, {}, {"eos_token_id": 1}, {"do_sample": False}, False, None, NO_FLAGS))
@example(case=Case("empty", QWEN, {}, {"eos_token_id": 1}, None, False, None, NO_FLAGS))
@example(case=Case("auto", QWEN, {}, {"eos_token_id": 1}, {"max_new_tokens": 4, "max_tokens": 5}, False, None,
                   NO_FLAGS))
def test_the_generation_config_defaults_what_a_request_leaves_unset(tiny_llama: str, case: Case) -> None:
    expected = ref_defaults(case)
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        try:
            got = prepared(case, tiny_llama, root)
        except ConfigError as exc:
            assert exc.field == expected, f"ConfigError naming {exc.field!r} ({exc}); expected {expected!r}"
            return
    assert not isinstance(expected, str), f"accepted; expected a ConfigError naming {expected!r}"
    assert got.default_sampling == expected
    assert got.eos_token_ids == ref_eos(case)
    generation = ref_generation(case)
    if case.source == "missing":  # config.json's attributes, without transformers' bookkeeping keys
        assert {key: got.generation_config.get(key) for key in generation} == generation
        assert not {"_from_model_config", "transformers_version"} & set(got.generation_config)
    else:
        assert got.generation_config == generation  # the whole file, the model folder's for vllm too
    assert request_params(got.default_sampling, case.request) == ref_params(expected, case.request)
    assert cli_params(got.default_sampling, case.flags) == ref_cli(expected, case.flags)
