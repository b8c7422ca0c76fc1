"""Bad values on the command line are one `asyncllm: error:` line and exit 2, before anything starts."""

from __future__ import annotations

import pytest

from asyncllm import cli_serve
from asyncllm.cli import main
from asyncllm.errors import ConfigError
from asyncllm.protocol_control import config_error_from_parts, config_error_parts


def _exit_code_and_error(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [(["--dtype", "float99"], "dtype='float99'"),
                                          (["--max-tokens", "0"], "max_tokens"),
                                          (["--temperature", "-1"], "temperature"),
                                          (["--model", "/nonexistent/model"], "model='/nonexistent/model'")])

def test_generate_refuses_bad_values_before_the_engine_starts(flags, named, capsys) -> None:
    code, err = _exit_code_and_error(["generate", "--model", "some/model", *flags], capsys)
    assert code == 2 and f"asyncllm: error: {named}" in err and "Traceback" not in err


@pytest.mark.parametrize("flags, named", [
    (["--hf-overrides", '{"num_attention_heads": "x"}'], "hf_overrides={'num_attention_heads': 'x'}"),
    (["--hf-overrides", '{"architectures": "LlamaForCausalLM"}'], "architectures as a list"),
    (["--config", "f.yaml"], "unrecognized arguments: --config"),  # not read as --config-format
])
def test_generate_refuses_a_config_it_cannot_serve_in_one_line(flags, named, capsys) -> None:
    code, err = _exit_code_and_error(["generate", *flags], capsys)
    assert code == 2 and named in err and "Traceback" not in err


def test_a_missing_runtime_dir_is_a_config_error(monkeypatch, tmp_path) -> None:
    from asyncllm.ipc_dirs import private_ipc_dir

    monkeypatch.setenv("ASYNCLLM_RUNTIME_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="ASYNCLLM_RUNTIME_DIR"):
        private_ipc_dir()


@pytest.mark.parametrize("flags, named", [(["/nonexistent/model"], "model='/nonexistent/model'"),
                                          (["--generation-config", "/nonexistent"], "generation_config='/nonexistent'"),
                                          (["--port", "65536"], "--port"), (["--port", "-1"], "--port"),
                                          (["--max-n", "0"], "max_n=0"), (["--max-prompts", "0"], "max_prompts=0"),
                                          (["--max-body-bytes", "-1"], "max_body_bytes=-1"),
                                          (["--max-tokens-limit", "0"], "max_tokens_limit=0"),
                                          (["--allowed-media-domains", "upload.wikimedia.org"],
                                           "asyncllm fetches no http(s) media")])
def test_serve_refuses_a_model_or_port_it_cannot_serve_before_the_server_starts(flags, named, capsys,
                                                                                  monkeypatch) -> None:
    def no_server(*args: object) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(cli_serve, "serve_app", no_server)
    code, err = _exit_code_and_error(["serve", "--port", "0", *flags], capsys)  # a later --port wins
    assert code == 2 and "error: " in err and named in err


def test_server_limits_below_one_are_refused_as_they_would_refuse_every_request() -> None:
    from asyncllm.integrations.openai_protocol import ServerLimits

    for field in ("max_body_bytes", "max_audio_bytes", "max_n", "max_tokens", "max_prompts"):
        with pytest.raises(ConfigError) as info:
            ServerLimits(**{field: 0})
        assert info.value.field == field
    assert ServerLimits(max_tokens=None, max_n=1).max_tokens is None


@pytest.mark.parametrize("value", ["cuda", frozenset({1})])  # a literal comes back as itself, the rest as its repr
def test_a_worker_config_error_relayed_twice_shows_the_value_once(value) -> None:
    sent = ConfigError("device", value, "a device this machine has")
    relayed = config_error_from_parts(config_error_parts(config_error_from_parts(config_error_parts(sent))))
    assert str(relayed) == str(sent) and relayed.value == (value if isinstance(value, str) else repr(value))


@pytest.mark.parametrize("argv", [["throughput", "--num-requests", "0"], ["latency", "--input-len", "-1"],
                                  ["latency", "--num-iters", "x"], ["serve", "--request-rate", "0"],
                                  ["serve", "--request-rate", "nan"]])
def test_bench_refuses_counts_and_rates_below_one_request(argv, capsys) -> None:
    from asyncllm.bench.cli import parser

    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(argv)
    assert exit_info.value.code == 2 and "error: argument --" in capsys.readouterr().err


def test_bench_accepts_an_infinite_rate_and_refuses_an_output_folder_missing_or_named(capsys, tmp_path) -> None:
    from asyncllm.bench.cli import main, parser

    assert parser().parse_args(["serve", "--request-rate", "inf"]).request_rate == float("inf")
    out = str(tmp_path / "missing" / "result.json")
    assert main(["latency", "--preset", "tiny", "--output-json", out]) == 2
    assert capsys.readouterr().err.strip() == (f"asyncllm bench: output_json={out!r} is not allowed: a file in a "
                                               "folder that exists (checked before the run)")
    assert main(["latency", "--preset", "tiny", "--output-json", str(tmp_path)]) == 2  # a folder, not a file
    assert capsys.readouterr().err.strip() == (f"asyncllm bench: output_json={str(tmp_path)!r} is not allowed: a "
                                               "file, not a folder (checked before the run)")


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version(flag, capsys) -> None:
    from asyncllm import __version__

    with pytest.raises(SystemExit) as exit_info:
        main([flag])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == __version__


def test_several_api_keys_without_a_model_are_refused_as_they_may_have_taken_it(capsys, tmp_path) -> None:
    from asyncllm.cli import _parser, parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(_parser(), ["serve", "--api-key", "secret", "org/real-model"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "asyncllm: error: --api-key took 2 keys and there is no MODEL" in err
    assert "put MODEL before --api-key, or end the keys with `--`" in err
    config = tmp_path / "serve.yaml"
    config.write_text("model: org/real-model\napi-key: [k1, k2]\n")
    keys_only = tmp_path / "keys.yaml"
    keys_only.write_text("api-key: [k1, k2]\n")
    for argv, model in ((["serve", "org/m", "--api-key", "k1", "k2"], "org/m"),
                        (["serve", "--api-key", "k1", "k2", "--", "org/m"], "org/m"),
                        (["serve", "--api-key", "k1", "k2", "--"], None),  # the bundled model, two keys
                        (["serve", "--config", str(config)], "org/real-model"),
                        (["serve", "--config", str(keys_only)], None),  # a file's keys take no MODEL
                        (["serve", "--config", str(config), "--api-key", "k1", "k2"], "org/real-model")):
        args = parse_args(_parser(), argv)
        assert (args.model, args.api_key) == (model, ["k1", "k2"])


@pytest.mark.parametrize("command", [["generate"], ["serve", "--port", "0"], ["engine", "--address", "ipc:///nowhere"],
                                     ["bench", "latency", "--preset", "tiny"]])
def test_a_bad_hub_timeout_variable_is_one_line_not_huggingface_hubs_import_traceback(command: list[str]) -> None:
    """huggingface_hub reads HF_HUB_ETAG_TIMEOUT with int() at its import, which transformers' import makes (serve's
    engine constructor, generate's start): ``abc`` was that import's ValueError traceback, exit 1, until 2026-12-07."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_ETAG_TIMEOUT": "abc"}
    done = subprocess.run([sys.executable, "-m", "asyncllm", *command], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "HF_HUB_ETAG_TIMEOUT='abc' is not allowed" in done.stderr.splitlines()[-1]
