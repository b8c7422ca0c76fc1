"""Default sampling parameters from generation_config.json (vLLM's --generation-config)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from asyncllm import ConfigError, EngineConfig
from asyncllm.engine.defaults import default_sampling_fields
from asyncllm.generation_config import read_generation_config, sampling_fields_of


def _folder(tmp_path, **fields) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return str(tmp_path)


def _defaults(generation_config: str, folder: str, overrides: dict | None = None) -> dict:
    generation = read_generation_config(generation_config, folder)
    return default_sampling_fields(sampling_fields_of(generation_config, generation), overrides)


def test_the_models_sampling_fields_become_defaults(tmp_path) -> None:
    folder = _folder(tmp_path, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=512, eos_token_id=1,
                     do_sample=True, bos_token_id=0)
    assert _defaults("auto", folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                       "max_tokens": 512}
    assert _defaults("vllm", folder) == {}
    assert _defaults("auto", folder, {"temperature": 0.1}) == {
        "temperature": 0.1, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    assert _defaults("vllm", folder, {"top_k": 5}) == {"top_k": 5}
    nulls = EngineConfig.create("m", override_generation_config={"temperature": None, "max_new_tokens": None})
    assert _defaults("auto", folder, nulls.override_generation_config) == {"top_p": 0.95, "top_k": 20}  # vLLM's


def test_do_sample_false_is_not_read(tmp_path) -> None:
    """vLLM's get_diff_sampling_param takes the sampling fields whatever ``do_sample`` says."""
    folder = _folder(tmp_path, do_sample=False, temperature=0.7, top_p=0.8, top_k=5, min_p=0.1,
                     repetition_penalty=1.1)
    assert _defaults("auto", folder) == {"temperature": 0.7, "top_p": 0.8, "top_k": 5, "min_p": 0.1,
                                         "repetition_penalty": 1.1}


def test_missing_and_bad_files(tmp_path) -> None:
    assert _defaults("auto", str(tmp_path)) == {}  # no file: no defaults
    with pytest.raises(ConfigError, match="generation_config"):
        _defaults(str(tmp_path), "/model")  # a folder given explicitly must hold one
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        _defaults("auto", str(tmp_path))


def test_override_generation_config_is_checked() -> None:
    EngineConfig.create("m", override_generation_config={"temperature": 0.5})
    for bad in ({"temperature": -1.0}, {"no_such_field": 1}, [1]):
        with pytest.raises(ConfigError) as info:
            EngineConfig.create("m", override_generation_config=bad)
        assert info.value.field == "override_generation_config"
    # as vLLM's get_diff_sampling_param, only its six keys: another would default engine.generate but not the server
    with pytest.raises(ConfigError, match="'logit_bias' is not one"):
        EngineConfig.create("m", override_generation_config={"temperature": 0.0, "logit_bias": {5: -100.0}})


def _prepared(model: str, generation_config: str):
    from asyncllm.engine.prepare import prepare

    return prepare(EngineConfig.create(model, generation_config=generation_config, skip_tokenizer_init=True))


def test_the_host_reads_the_file_the_field_names(tiny_llama: str, tmp_path) -> None:
    """The host's one read (asyncllm/engine/prepare.py): a folder gives the defaults, the EOS ids and the rules' keys;
    ``vllm`` gives no sampling defaults but the model folder's EOS ids (as vLLM) and rules' keys."""
    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(tiny_llama):  # the tiny checkpoint, its generation config's EOS ids [1, 13]
        if name != "generation_config.json":
            (model / name).symlink_to(os.path.join(tiny_llama, name))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 13], "top_k": 2}))
    folder = _folder(tmp_path, temperature=0.3, eos_token_id=11, suppress_tokens=[4])
    assert _prepared(str(model), "auto").eos_token_ids == [1, 13]
    given = _prepared(str(model), folder)
    assert given.default_sampling == {"temperature": 0.3} and given.eos_token_ids == [1, 11]
    assert given.generation_config["suppress_tokens"] == [4]
    off = _prepared(str(model), "vllm")
    assert (off.default_sampling, off.eos_token_ids) == ({}, [1, 13])
    assert off.generation_config == {"eos_token_id": [1, 13], "top_k": 2}


def test_a_folder_without_the_file_reads_config_jsons_generation_attributes(tiny_llama: str, tmp_path) -> None:
    """As vLLM's ``try_get_generation_config`` (and transformers' ``generate``): no generation_config.json, so
    config.json's generation attributes (``GenerationConfig.from_model_config``) stand in: its EOS ids stop requests
    with the tokenizer loaded too, its ``max_new_tokens`` defaults ``max_tokens``; a worker's rebuilt config agrees."""
    from asyncllm.engine.prepare import prepare
    from asyncllm.generation_config import from_model_config
    from asyncllm.models.checkpoint import hf_config_from_json, hf_config_json, served_hf_config

    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(tiny_llama):
        if name not in ("generation_config.json", "config.json"):
            (model / name).symlink_to(os.path.join(tiny_llama, name))
    config = json.loads(open(os.path.join(tiny_llama, "config.json")).read())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": [1, 13], "max_new_tokens": 7}))
    prepared = prepare(EngineConfig.create(str(model)))
    assert prepared.eos_token_ids == [1, 13] and prepared.default_sampling == {"max_tokens": 7}
    assert prepared.generation_config["eos_token_id"] == [1, 13]
    assert _prepared(str(model), "vllm").eos_token_ids == [1, 13]
    hf_config = served_hf_config(str(model), None, False)
    assert from_model_config(hf_config_from_json(hf_config_json(hf_config))) == from_model_config(hf_config)


def test_a_generation_attribute_transformers_refuses_in_config_json_is_a_config_error(tmp_path) -> None:
    from asyncllm.models.checkpoint import hf_config_from_json

    bad = hf_config_from_json(json.dumps({"model_type": "llama", "max_new_tokens": 0}))
    with pytest.raises(ConfigError) as info:
        read_generation_config("auto", str(tmp_path), bad)
    assert info.value.field == "model" and info.value.value == str(tmp_path)
    assert "config.json (it has no generation_config.json)" in str(info.value) and "max_new_tokens" in str(info.value)


_WORKER_RULES = """
import json, sys
import torch
from asyncllm.models.checkpoint import hf_config_from_json
from workers.generation_rules import GenerationRules
rules = GenerationRules.of("auto", sys.argv[1], 100, torch.device("cpu"), hf_config_from_json(sys.argv[2]))
print(json.dumps([rules._suppress.tolist(), rules._begin.tolist(), rules.timestamps, "transformers" in sys.modules]))
"""


def test_a_workers_rules_from_config_json_import_no_transformers_and_match_from_model_config(tmp_path) -> None:
    """A worker (a WireConfig, no generation_config.json) reads config.json's suppress_tokens without transformers
    (its import costs a worker's start about 2 s), as `from_model_config` reads them: the decoder's where the config
    sets none, Whisper's timestamp keys dropped (not GenerationConfig attributes)."""
    import subprocess
    import sys

    from asyncllm.generation_config import from_model_config, rule_keys_of
    from asyncllm.models.checkpoint import hf_config_from_json

    values = {"model_type": "whisper", "suppress_tokens": [9, 5], "eos_token_id": 2, "no_timestamps_token_id": 50,
              "task_to_id": {"transcribe": 7}, "text_config": {"model_type": "t", "begin_suppress_tokens": [3],
                                                               "suppress_tokens": [1]}}
    wire = hf_config_from_json(json.dumps(values))
    expected = from_model_config(wire)  # what a worker read before (with transformers)
    assert "no_timestamps_token_id" not in expected
    assert {key: expected[key] for key in ("suppress_tokens", "begin_suppress_tokens")} == {
        "suppress_tokens": [9, 5], "begin_suppress_tokens": [3]} == rule_keys_of(wire)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", _WORKER_RULES, str(tmp_path), json.dumps(values)], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == [[5, 9], [3], None, False]


def test_override_generation_config_takes_generation_config_keys() -> None:
    """vLLM maps generation_config.json's names: max_new_tokens is max_tokens; both at once is refused."""
    config = EngineConfig.create("m", override_generation_config={"max_new_tokens": 5, "temperature": 0.5})
    assert config.override_generation_config == {"max_tokens": 5, "temperature": 0.5}
    with pytest.raises(ConfigError, match="max_new_tokens is max_tokens"):
        EngineConfig.create("m", override_generation_config={"max_new_tokens": 5, "max_tokens": 6})


@pytest.mark.parametrize(("generation_config", "overrides", "requested", "expected"), [
    ("auto", None, None, 512),  # the file's max_new_tokens: the default, not a cap (vLLM's get_max_tokens)
    ("auto", None, 1000, 1000),
    ("auto", {"max_new_tokens": 4}, None, 4),  # override_generation_config's caps what a request sets too
    ("auto", {"max_new_tokens": 4}, 12, 4),
    ("auto", {"max_new_tokens": 4}, 2, 2),
    ("folder", None, 1000, 512),  # a generation-config folder's max_new_tokens caps
    ("vllm", None, 1000, 1000),
])
def test_the_servers_max_tokens_are_vllms(tmp_path, generation_config: str, overrides: dict | None,
                                          requested: int | None, expected: int) -> None:
    from asyncllm.engine.defaults import sampling_overrides
    from asyncllm.integrations.openai_protocol import ServerLimits
    from asyncllm.integrations.openai_sampling import resolve_max_tokens, with_max_tokens_cap

    folder = _folder(tmp_path, max_new_tokens=512)
    name = folder if generation_config == "folder" else generation_config
    overrides = sampling_overrides("override_generation_config", overrides)
    config = SimpleNamespace(generation_config=name, override_generation_config=overrides)
    defaults = with_max_tokens_cap(_defaults(name, folder, overrides), config)
    assert resolve_max_tokens(requested, ServerLimits(), defaults) == expected


def test_the_server_caps_with_the_engines_config() -> None:
    import asyncio

    from asyncllm.integrations.openai_server import OpenAIServer

    config = SimpleNamespace(generation_config="auto", override_generation_config={"max_tokens": 4})
    engine = SimpleNamespace(started=True, config=config, default_sampling_fields=lambda: {"max_tokens": 4})
    defaults = asyncio.run(OpenAIServer._sampling_defaults(SimpleNamespace(engine=engine)))
    assert defaults == {"max_tokens": 4, "max_tokens_cap": 4}


def test_the_file_given_for_its_folder_is_refused_naming_what_was_given(tmp_path) -> None:
    """``--generation-config DIR/generation_config.json`` (the file, not its folder) was refused as
    ``generation_config='DIR/generation_config.json/generation_config.json'``, a path never given, with an OS error,
    until 2026-12-07."""
    from asyncllm.generation_config import read_generation_config

    given = tmp_path / "generation_config.json"
    given.write_text('{"temperature": 0.3}')
    with pytest.raises(ConfigError) as info:
        read_generation_config(str(given), str(tmp_path))
    assert info.value.field == "generation_config" and info.value.value == str(given)
    assert "a folder holding a generation_config.json" in str(info.value)
