"""vLLM's ``runner`` / ``convert`` and deprecated ``task`` (asyncllm/config_runner.py, asyncllm/engine/runner.py):
values checked by name, resolved for the architecture as vLLM's ModelConfig resolves them (on the host, nothing
spawned: `prepare`), the refusals of requests the resolved runner does not serve (host and core), the CLI flags.
A running engine: tests/engine/test_runner_engine.py."""

from __future__ import annotations

import warnings

import pytest

from asyncllm import InvalidRequestError
from asyncllm.cli import _parser, parse_args
from asyncllm.cli_config import dash_flag_names
from asyncllm.config import EngineConfig
from asyncllm.engine.pooling_model import pooling_model_of
from asyncllm.engine.prepare import prepare
from asyncllm.engine.runner import TASK_DEPRECATION
from asyncllm.engine.validation import served_tasks
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.pooling import PoolingParams
from classifier_utils import tiny_classifier


@pytest.fixture(scope="module")
def classifier(tiny_llama: str, tmp_path_factory) -> str:
    return tiny_classifier(tiny_llama, str(tmp_path_factory.mktemp("llama-classifier")), num_labels=2, seed=1)


def _resolved(model: str, **fields: object) -> tuple[str, str, object]:
    config = prepare(EngineConfig.create(model, **fields)).config
    return config.runner, config.convert, config.task


def test_the_fields_default_to_auto_and_take_vllms_values() -> None:
    config = EngineConfig.create("m", runner="pooling", convert="embed")
    assert (config.runner, config.convert, config.task) == ("pooling", "embed", None)
    assert EngineConfig.create("m").to_dict()["runner"] == "auto" and EngineConfig.create("m").convert == "auto"
    assert EngineConfig.create("m", task="embed").task == "embed"


@pytest.mark.parametrize("fields, field, message", [
    ({"runner": "encode"}, "runner", "one of 'auto', 'generate', 'pooling', 'draft'"),
    ({"runner": "draft"}, "runner", "speculative_config"),
    ({"convert": "embedding"}, "convert", "one of 'auto', 'none', 'embed', 'classify', 'reward'"),
    ({"runner": "generate", "convert": "embed"}, "convert", "runner='pooling'"),
    ({"task": "chat"}, "task", "one of 'auto', 'generate'"),
    ({"task": "draft"}, "task", "speculative_config"),
    ({"task": "embed", "runner": "pooling"}, "task", "deprecated spelling of runner and convert"),
])
def test_bad_values_are_config_errors_naming_the_field(fields: dict, field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        EngineConfig.create("m", **fields)
    assert info.value.field == field and not isinstance(info.value, NotBuiltError)


@pytest.mark.parametrize("fields", [{"convert": "reward"}, {"task": "reward"}])
def test_the_reward_adapter_is_built(fields: dict) -> None:
    EngineConfig.create("m", **fields)  # vLLM's as_reward_model: tests/engine/test_reward_models.py


def test_a_causal_lm_resolves_as_vllm_does(tiny_llama: str) -> None:
    assert _resolved(tiny_llama) == ("auto", "auto", None)  # asyncllm's auto: generation and embeddings
    assert _resolved(tiny_llama, runner="generate") == ("generate", "none", None)
    assert _resolved(tiny_llama, runner="pooling") == ("pooling", "embed", None)  # vLLM's default convert
    assert _resolved(tiny_llama, convert="embed") == ("pooling", "embed", None)
    assert _resolved(tiny_llama, runner="pooling", convert="embed") == ("pooling", "embed", None)
    assert _resolved(tiny_llama, convert="none") == ("auto", "none", None)


def test_embed_on_a_causal_lm_pools_as_vllms_as_embedding_model(tiny_llama: str) -> None:
    """vLLM's as_embedding_model: the last token's hidden state, normalized; no generation under runner=pooling."""
    model = prepare(EngineConfig.create(tiny_llama, runner="pooling", convert="embed")).pooling_model
    assert (model.runner, model.pooling_type, model.normalize, model.generates) == ("pooling", "LAST", True, False)
    assert model.apply(PoolingParams()).normalize is True


@pytest.mark.parametrize("fields, field, message", [
    ({"runner": "pooling", "convert": "none"}, "convert", "does not support `--runner pooling`"),
    ({"convert": "classify"}, "convert", "LlamaForCausalLM has none"),
    ({"task": "classify"}, "task", "LlamaForCausalLM has none"),
])
def test_what_a_causal_lm_cannot_be_is_refused(tiny_llama: str, fields: dict, field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        prepare(EngineConfig.create(tiny_llama, **fields))
    assert info.value.field == field


def test_a_classifier_resolves_to_the_pooling_runner(classifier: str) -> None:
    assert _resolved(classifier) == ("pooling", "none", None)  # vLLM: "Resolved `--runner auto` to ..."
    assert _resolved(classifier, convert="classify") == ("pooling", "classify", None)
    for fields, field in (({"runner": "generate"}, "runner"), ({"convert": "embed"}, "convert")):
        with pytest.raises(ConfigError) as info:
            prepare(EngineConfig.create(classifier, **fields))
        assert info.value.field == field


@pytest.mark.parametrize("task, want, hint", [
    ("embed", ("pooling", "embed"), "Please replace this option with `--convert embed`"),
    ("embedding", ("pooling", "embed"), "`--convert embed`"),
    ("score", ("pooling", "embed"), "`--convert embed`"),  # not a cross-encoder: embeddings' cosine
    ("generate", ("generate", "none"), "Please remove this option"),
    ("transcription", ("generate", "none"), "Please remove this option"),
    ("auto", ("auto", "auto"), "Please remove this option."),
])
def test_task_maps_onto_runner_and_convert_with_vllms_warning(tiny_llama: str, task: str, want: tuple,
                                                               hint: str) -> None:
    with pytest.warns(DeprecationWarning) as caught:
        got = _resolved(tiny_llama, task=task)
    assert got == (*want, None)
    assert any(str(w.message).startswith(f"{TASK_DEPRECATION} ") and hint in str(w.message) for w in caught)


def test_task_score_on_a_cross_encoder_is_classify(classifier: str) -> None:
    with pytest.warns(DeprecationWarning, match="--convert classify"):
        assert _resolved(classifier, task="score") == ("pooling", "classify", None)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="no LM head") as info:
        prepare(EngineConfig.create(classifier, task="generate"))
    assert info.value.field == "task"


def test_the_host_refuses_what_the_runner_does_not_serve() -> None:
    generate = pooling_model_of("LlamaForCausalLM", object(), runner="generate")
    pooling = pooling_model_of("LlamaForCausalLM", object(), runner="pooling")
    generate.check(None)
    pooling.check(PoolingParams())
    with pytest.raises(InvalidRequestError, match="runner='generate'") as info:
        generate.check(PoolingParams())
    assert info.value.field == "model"
    with pytest.raises(InvalidRequestError, match="runner='pooling': it serves embeddings only") as info:
        pooling.check(None)
    assert info.value.field == "prompt"


def test_the_core_refuses_what_the_runner_does_not_serve() -> None:
    assert served_tasks(["LlamaForCausalLM"]) == {"generate", "embed"}
    assert served_tasks(["LlamaForCausalLM"], "generate") == {"generate"}
    assert served_tasks(["LlamaForCausalLM"], "pooling") == {"embed"}
    assert served_tasks(["Qwen3ForSequenceClassification"], "pooling") == {"classify"}


@pytest.mark.parametrize("command", ["serve", "engine", "generate"])
def test_the_cli_takes_vllms_flags(command: str) -> None:
    args = parse_args(_parser(), dash_flag_names([command, "/m", "--runner", "pooling", "--convert", "embed"]))
    assert (args.runner, args.convert) == ("pooling", "embed")
    assert parse_args(_parser(), dash_flag_names([command, "/m", "--task", "embed"])).task == "embed"
