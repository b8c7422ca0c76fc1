"""vLLM's spellings on asyncllm's command line and in its environment (asyncllm/cli_vllm.py, asyncllm/envs.py):
VLLM_API_KEY, the other VLLM_* variables warned about, serve --model, the dotted JSON flags, -q, vLLM flags asyncllm
names otherwise, a list option that took MODEL, None for vLLM's Optional fields, SamplingParams(structured_outputs)."""

from __future__ import annotations

import json
import logging

import pytest

from asyncllm import SamplingParams, envs
from asyncllm.cli import _parser, parse_args
from asyncllm.cli_config import dash_flag_names
from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidRequestError


def _parse(argv: list[str]):
    return parse_args(_parser(), dash_flag_names(argv))


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_serve_takes_vllm_api_key_after_asyncllm_api_key(monkeypatch) -> None:
    from asyncllm import cli_commands
    from asyncllm.integrations import openai_server

    seen = {}
    monkeypatch.setattr(openai_server, "create_app", lambda engine, **kw: seen.update(kw))
    monkeypatch.delenv("ASYNCLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-secret")
    args = _parse(["serve"])
    cli_commands._serve_app(args, _parser())
    assert seen["api_key"] == ["vllm-secret"]  # a vLLM deployment's key is not dropped: no open server
    monkeypatch.setenv("ASYNCLLM_API_KEY", "ours")
    assert envs.api_key() == "ours"


def test_each_vllm_variable_set_is_warned_about_naming_its_twin(monkeypatch, caplog) -> None:
    for name in envs.unread_vllm_names():
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASH_ATTN")
    monkeypatch.setenv("VLLM_USE_V1", "1")
    monkeypatch.setenv("VLLM_API_KEY", "read by serve, not warned about")
    monkeypatch.setattr(envs, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        envs.warn_unknown()
        envs.warn_unknown()  # a second engine start in the process: nothing new to warn about
    warned = [r.getMessage() for r in caplog.records if "vLLM's environment variable" in r.getMessage()]
    assert warned == [
        "vLLM's environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING is set: asyncllm does not read it (set "
        "ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING instead)",
        "vLLM's environment variable VLLM_ATTENTION_BACKEND is set: asyncllm does not read it (use "
        "--attention-backend (attention_backend=) instead)",
        "vLLM's environment variable VLLM_CPU_KVCACHE_SPACE is set: asyncllm does not read it (set "
        "ASYNCLLM_CPU_KVCACHE_SPACE_GB instead)",
        "vLLM's environment variable VLLM_USE_V1 is set: asyncllm does not read it (it has no asyncllm counterpart; "
        "docs/configuration.md#environment-variables lists asyncllm's variables)"]
    assert envs.vllm_twins()["VLLM_LOGGING_LEVEL"] == "ASYNCLLM_LOGGING_LEVEL"


@pytest.mark.parametrize("argv", [["serve", "--served-model-name", "my-llama", "/models/X"],
                                  ["serve", "--port", "1", "--served-model-name", "a", "/models/X"]])
def test_a_served_name_list_that_took_the_model_is_refused(argv, capsys) -> None:
    err = _refused(argv, capsys)
    assert err.startswith("asyncllm: error: --served-model-name took 2 names and there is no MODEL")
    assert "('/models/X'?)" in err
    assert _parse(["serve", "/models/X", "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    assert _parse(["serve", "--served-model-name", "a", "b", "--"]).model is None


def test_list_options_with_connect_are_not_taken_for_the_model(capsys) -> None:
    connect = ["serve", "--connect", "tcp://127.0.0.1:5555"]
    assert _parse([*connect, "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    assert len(_parse([*connect, "--lora-modules", "a=/p", "b=/q"]).lora_modules) == 2
    # without --connect too: each module's type read it, so a MODEL among them was refused as no NAME=PATH
    assert len(_parse(["serve", "--enable-lora", "--lora-modules", "a=/p", "b=/q"]).lora_modules) == 2


def test_serve_start_line_names_the_model() -> None:
    from asyncllm.cli_serve import served_what

    assert served_what(_parse(["serve"])) == "the bundled tiny model (no MODEL given)"
    assert served_what(_parse(["serve", "/m", "--served-model-name", "a"])) == "/m as a"


@pytest.mark.parametrize("argv", [["serve", "--model", "/m", "--port", "9"], ["serve", "--port", "9", "--model=/m"]])
def test_serve_model_flag_is_the_positional_with_a_warning(argv, capsys) -> None:
    args = _parse(argv)
    assert (args.model, args.port) == ("/m", 9)
    assert "--model is deprecated" in capsys.readouterr().err


def test_dotted_json_flags_merge_into_the_object() -> None:
    args = _parse(["serve", "/m", "--limit-mm-per-prompt.image", "2", "--speculative-config.method", "ngram",
                   "--speculative_config.num_speculative_tokens=3", "--hf-overrides", '{"a": {"b": 1}}',
                   "--hf-overrides.max_position_embeddings", "256", "--hf-overrides.a.c+", "x",
                   "--hf-overrides.a.c+", "2"])
    assert args.limit_mm_per_prompt == {"image": 2}
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.hf_overrides == {"a": {"b": 1, "c": ["x", 2]}, "max_position_embeddings": 256}
    assert dash_flag_names(["--hf_overrides.max_position_embeddings=1"]) == ["--hf-overrides.max_position_embeddings=1"]


def test_vllm_flags_with_no_effect_are_noted_and_those_not_built_refused(capsys) -> None:
    args = _parse(["serve", "/m", "--disable-fastapi-docs", "--disable-frontend-multiprocessing", "--port", "9"])
    assert args.port == 9 and capsys.readouterr().err.count("has no effect here") == 2
    assert _parse(["serve", "/m", "--api-server-count", "1", "--port", "9"]).port == 9  # vLLM's default: noted
    assert "--api-server-count 1 has no effect here" in capsys.readouterr().err
    assert _parse(["serve", "/m", "--lora-dtype", "auto", "--port", "9"]).port == 9
    assert "--lora-dtype auto has no effect here" in capsys.readouterr().err
    for flag in (["--api-server-count", "2"], ["--api-server-count=4"], ["--enable-log-outputs"],
                 ["--fully-sharded-loras"], ["--lora-dtype", "float32"], ["--lora-extra-vocab-size", "256"]):
        with pytest.raises(SystemExit):
            _parse(["serve", "/m", *flag])
        assert f"vLLM's {flag[0].split('=')[0]}: not built" in capsys.readouterr().err


def test_limit_mm_per_prompt_takes_mistral_model_cards_key_value_counts(capsys) -> None:
    """``--limit_mm_per_prompt 'image=10'`` as Mistral's model cards write it (vLLM's older form), beside JSON and a
    dotted key; a count that is not a number is the flag's error."""
    argv = ["serve", "/m", "--tokenizer_mode", "mistral", "--limit_mm_per_prompt", "image=10"]
    assert _parse(dash_flag_names(argv)).limit_mm_per_prompt == {"image": 10}
    args = _parse(["serve", "/m", "--limit-mm-per-prompt", "image=2, video=1", "--limit-mm-per-prompt.audio", "0"])
    assert args.limit_mm_per_prompt == {"image": 2, "video": 1, "audio": 0}
    with pytest.raises(SystemExit):
        _parse(["serve", "/m", "--limit-mm-per-prompt", "image=many"])
    assert "--limit-mm-per-prompt" in capsys.readouterr().err


def test_serve_json_object_flags_take_dotted_keys_and_one_parser_refuses_what_is_not_an_object(capsys) -> None:
    """--default-chat-template-kwargs (typed `json_object`) takes dotted keys as the engine's dict fields do; a value
    that is no JSON object is each flag's error (the engine's naming its type)."""
    args = _parse(["serve", "/m", "--default-chat-template-kwargs.enable_thinking", "false"])
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert _refused(["serve", "/m", "--default-chat-template-kwargs", "[1]"], capsys).endswith(
        "argument --default-chat-template-kwargs: not a JSON object: '[1]'")
    assert _refused(["serve", "/m", "--hf-overrides", "[1]"], capsys).endswith(
        "argument --hf-overrides: '[1]' is not dict or none")


def test_q_is_quantization() -> None:
    assert _parse(["serve", "/m", "-q", "fp8"]).quantization == "fp8"


def test_vllm_flags_are_mapped_or_refused_by_name(capsys) -> None:
    assert _parse(["serve", "/m", "--disable-mm-preprocessor-cache"]).mm_processor_cache_gb == 0
    config = json.dumps({"disable_any_whitespace": True})
    assert _parse(["serve", "/m", "--structured-outputs-config", config]).structured_output_disable_any_whitespace
    assert _parse(["serve", "/m", "--structured-outputs-config.disable_any_whitespace", "true"]) \
        .structured_output_disable_any_whitespace
    for argv in (["-O3"], ["-O", "0"], ["--compilation-config", "{}"], ["--allowed-media-domains", "a.org", "b.org"],
                 ["--allowed-media-domains=a.org"]):
        assert _refused(["serve", "/m", *argv], capsys).startswith("asyncllm serve: error: vLLM's ")
    assert "--allowed-media-domains: asyncllm fetches no http(s) media" in _refused(
        ["serve", "/m", "--allowed-media-domains", "a.org"], capsys)
    assert _parse(["serve", "/m", "--allowed-local-media-path", "/media"]).allowed_local_media_path == "/media"
    assert _refused(["serve", "/m", "--bogus-flag"], capsys) == \
        "asyncllm serve: error: unrecognized arguments: --bogus-flag"


def test_a_refused_vllm_flag_in_a_config_file_is_refused_with_its_reason(tmp_path, capsys) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("allowed-media-domains: [a.org]\n")
    assert _refused(["serve", "/m", "--config", str(config)], capsys).startswith(
        f"asyncllm serve: error: vLLM's --allowed-media-domains (the key 'allowed-media-domains' of --config "
        f"{config}): asyncllm fetches no http(s) media")


def test_only_an_o_level_word_in_flag_position_is_refused(capsys) -> None:
    assert _parse(["generate", "-O3 is fast"]).prompt == "-O3 is fast"
    for word in ("-O", "-O0", "-O3", "-O=2"):
        assert _refused(["serve", "/m", word], capsys).startswith("asyncllm serve: error: vLLM's -O: not built")
    assert "vLLM's -O" not in _refused(["serve", "/m", "--api-key", "-O3"], capsys)  # a value's place


@pytest.mark.parametrize("spelling", [["--guided-decoding-backend"], ["--structured-outputs-config.backend"]])
def test_a_structured_output_backend_of_xgrammar_or_auto_is_accepted(spelling, capsys) -> None:
    for backend in ("xgrammar", "auto"):
        assert _parse(["serve", "/m", *spelling, backend]).model == "/m"
    assert _refused(["serve", "/m", *spelling, "outlines"], capsys).endswith(
        "'outlines': not built in asyncllm: structured output always uses xgrammar (auto or xgrammar are accepted)")


def test_binary_suffix_with_decimals_gets_vllms_message(capsys) -> None:
    assert _refused(["serve", "/m", "--max-model-len", "0.5K"], capsys).endswith(
        "Decimals are not allowed with binary suffixes like K. Did you mean 0.5k?")


@pytest.mark.parametrize("field", ["seed", "block_size", "enable_prefix_caching", "enable_chunked_prefill"])
def test_none_is_the_default_of_vllms_optional_fields(field) -> None:
    from asyncllm.bundled import bundled_model_path

    default = getattr(EngineConfig.create(bundled_model_path()), field)
    assert getattr(EngineConfig.create(bundled_model_path(), **{field: None}), field) == default


def test_sampling_params_take_vllms_structured_outputs() -> None:
    params = SamplingParams(structured_outputs={"regex": "a+", "disable_any_whitespace": False})
    params.validate()
    assert params.structured.regex == "a+" and params.structured_outputs is None
    assert SamplingParams(guided_decoding={"json_object": True}).structured.json == {"type": "object"}
    with pytest.raises(InvalidRequestError, match="structural_tag: not built in asyncllm"):
        SamplingParams(structured_outputs={"structural_tag": "x"})
    for name in ("structured_outputs", "guided_decoding"):  # asyncllm's own fields pass through as in `structured`
        params = SamplingParams(**{name: {"json": {"type": "object"}, "start_after": "</think>"}})
        assert params.structured.start_after == "</think>" and params.structured.json == {"type": "object"}


def _sampling_reads(value: dict):
    return SamplingParams(structured_outputs=value).structured


def _server_reads(value: dict):
    from asyncllm.integrations.openai_structured import structured_output

    return structured_output(None, value)[0]


@pytest.mark.parametrize("read", [_sampling_reads, _server_reads])
def test_sampling_params_and_the_server_read_structured_outputs_alike_as_vllm(read) -> None:
    """One reader (`from_vllm_structured`): vLLM ignores an unset field ({"foo": None}, its dataclass's False flags)
    and reads json_object 1 as true; asyncllm's own fields (start_after) are taken; older vLLM's backend "xgrammar" or
    "auto" is dropped, another refused; a field asyncllm does not build, set, is refused naming it."""
    assert read({"regex": "a", "foo": None, "disable_any_whitespace": False}).regex == "a"
    assert read({"json_object": 1}).json == {"type": "object"}
    assert read({"json_object": 0, "choice": ["x"]}).choice == ["x"]
    assert read({"regex": "a", "start_after": "</think>"}).start_after == "</think>"  # asyncllm's own field
    assert read({"regex": "a", "backend": "xgrammar"}).regex == read({"regex": "a", "backend": "auto"}).regex == "a"
    for bad, named in [({"foo": "x"}, "foo: not built"), ({"json_object": "yes"}, "json_object must be true or false"),
                       ({"regex": "a", "backend": "outlines"}, "backend='outlines': asyncllm's structured outputs")]:
        with pytest.raises(InvalidRequestError, match=f"^structured_outputs: {named}"):
            read(bad)


def test_structured_outputs_set_after_construction_is_not_dropped() -> None:
    params = SamplingParams()
    params.structured_outputs = {"regex": "b"}
    params.validate()
    assert params.structured.regex == "b" and params.structured_outputs is None


def test_vllms_structured_outputs_errors_name_what_is_wrong() -> None:
    import dataclasses

    with pytest.raises(InvalidRequestError, match="^structured_outputs: set json or json_object, not both$"):
        SamplingParams(structured_outputs={"json": {"type": "string"}, "json_object": True})
    with pytest.raises(InvalidRequestError, match="^guided_decoding: structured_outputs is given too"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding={"regex": "b"})

    @dataclasses.dataclass
    class VllmParams:  # vLLM's StructuredOutputsParams: it sets _backend once a request used it
        regex: object = None
        _backend: object = None

    assert SamplingParams(structured_outputs=VllmParams("a", "xgrammar")).structured.regex == "a"

    class Slotted:
        __slots__ = ("regex",)

        def __init__(self) -> None:
            self.regex = "c"

    assert SamplingParams(guided_decoding=Slotted()).structured.regex == "c"
    with pytest.raises(InvalidRequestError, match="^structured_outputs: must be a dict or vLLM's"):
        SamplingParams(structured_outputs="a+")


def test_a_revision_with_a_local_model_is_ignored_with_a_warning(tmp_path, capsys) -> None:
    from asyncllm.cli_args import engine_kwargs

    assert engine_kwargs(_parse(["serve", str(tmp_path), "--revision", "main", "--seed", "1"])) == {"seed": 1}
    assert "--revision main ignored: the model is a local folder" in capsys.readouterr().err
    assert engine_kwargs(_parse(["serve", "org/hub-model", "--revision", "main"])) == {"revision": "main"}


def test_vllm_flags_in_a_config_file_are_read_as_on_the_command_line(tmp_path, capsys) -> None:
    """A backend of xgrammar is accepted, another refused; vLLM's defaults (null, [], false) leave a flag unset."""
    config = tmp_path / "serve.yaml"
    config.write_text("guided-decoding-backend: xgrammar\nallowed-media-domains: []\nstructured-outputs-config: "
                      "{disable_any_whitespace: true}\ndisable-mm-preprocessor-cache: true\n")
    args = _parse(["serve", "/m", "--config", str(config)])
    assert args.structured_output_disable_any_whitespace is True and args.mm_processor_cache_gb == 0
    config.write_text("allowed-media-domains: null\ndisable-mm-preprocessor-cache: false\n")
    assert getattr(_parse(["serve", "/m", "--config", str(config)]), "mm_processor_cache_gb", None) is None
    config.write_text("guided-decoding-backend: outlines\n")
    assert _refused(["serve", "/m", "--config", str(config)], capsys).endswith(
        "'outlines': not built in asyncllm: structured output always uses xgrammar (auto or xgrammar are accepted)")


def test_a_config_files_dotted_keys_and_no_effect_flags_read_as_on_the_command_line(tmp_path, capsys) -> None:
    """vLLM expands the file into command-line words: ``hf-overrides.KEY`` merges into --hf-overrides' object (over
    the file's own hf_overrides), ``a.b`` nests, and a flag that changes nothing here gets its note."""
    config = tmp_path / "serve.yaml"
    config.write_text("hf-overrides.max_position_embeddings: 256\nhf_overrides: {a: 1}\nspeculative-config.method: "
                      "ngram\nspeculative-config.x.y: 2\ndisable-frontend-multiprocessing: true\n"
                      "disable-fastapi-docs: false\n")
    args = _parse(["serve", "/m", "--config", str(config)])
    assert args.hf_overrides == {"a": 1, "max_position_embeddings": 256}
    assert args.speculative_config == {"method": "ngram", "x": {"y": 2}}
    assert "--disable-frontend-multiprocessing has no effect here" in capsys.readouterr().err
    config.write_text("disable-fastapi-docs: 3\n")
    assert "the key 'disable-fastapi-docs' is a flag: give true or false" in _refused(
        ["serve", "/m", "--config", str(config)], capsys)
