"""`asyncllm serve` / `asyncllm engine`: flags generated from EngineConfig, and a real `serve` run."""

from __future__ import annotations

import argparse
import re
import signal
import ssl
import subprocess
import sys
from dataclasses import fields
from typing import get_type_hints

import httpx
import pytest

from asyncllm import config as config_module
from asyncllm.cli import _parser
from asyncllm.cli_args import ENGINE_FLAG_FIELDS, add_engine_args, engine_kwargs, markdown_table
from serve_helpers import line_with, wait_healthy


def _all_config_fields() -> set[str]:
    """Every flat field of every section of `EngineConfig` (its sections read from its fields, not listed here)."""
    engine = config_module.EngineConfig
    sections = [get_type_hints(engine)[f.name] for f in fields(engine)]
    return {f.name for section in sections for f in fields(section)}


def test_every_config_field_has_a_flag() -> None:
    assert set(ENGINE_FLAG_FIELDS) == _all_config_fields() - {"model", "prometheus_registry"}
    for command in ("serve", "engine"):
        options = _subparser(command)._option_string_actions
        for name in ENGINE_FLAG_FIELDS:
            assert "--" + name.replace("_", "-") in options, (command, name)


def test_flags_parse_to_config_kwargs() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-num-seqs", "3", "--no-enable-prefix-caching", "--max-model-len", "none",
                              "--gpu-memory-utilization", "0.5", "--dtype", "float32", "--disable-log-stats",
                              "--speculative-config", '{"k": 1}'])
    assert engine_kwargs(args) == {"max_num_seqs": 3, "enable_prefix_caching": False, "max_model_len": None,
                                   "gpu_memory_utilization": 0.5, "dtype": "float32", "disable_log_stats": True,
                                   "speculative_config": {"k": 1}}
    assert engine_kwargs(parser.parse_args([])) == {}  # unset flags keep EngineConfig's defaults
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-seqs", "many"])


def test_vllm_human_readable_sizes_and_fault_tolerance_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-model-len", "4k", "--max-num-batched-tokens", "2K", "--kv-cache-memory-bytes",
                              "2G", "--max-core-restarts", "2", "--worker-step-timeout-s", "none"])
    assert engine_kwargs(args) == {"max_model_len": 4000, "max_num_batched_tokens": 2048,
                                   "kv_cache_memory_bytes": 2 * 2**30, "max_core_restarts": 2,
                                   "worker_step_timeout_s": None}
    assert engine_kwargs(parser.parse_args(["--max-model-len", "auto"])) == {"max_model_len": -1}  # fitted by the core
    auto = engine_kwargs(parser.parse_args(["--max-model-len", "AUTO"]))
    assert config_module.EngineConfig.create("m", **auto).max_model_len == -1
    for bad in (["--kv-cache-memory-bytes", "2.5G"], ["--max-num-seqs", "4k"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_help_comes_from_the_field_docstrings() -> None:
    text = _subparser("serve").format_help()
    assert "Most requests in one step; None: 256, at most max_num_batched_tokens" in " ".join(text.split())


def test_connect_refuses_core_flags(capsys) -> None:
    from asyncllm.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--connect", "ipc:///tmp/x.sock", "--max-num-seqs", "4"])
    assert exit_info.value.code == 2 and "max_num_seqs" in capsys.readouterr().err


def test_connect_takes_host_side_flags() -> None:
    """`serve --connect` with host-side flags only: the attached host's own (`config.HOST_SIDE_FIELDS`)."""
    from asyncllm.cli_commands import _serve_engine

    args = _subparser("serve").parse_args(["--connect", "ipc:///tmp/x.sock", "--stream-interval", "2",
                                           "--disable-log-stats"])
    engine, _ = _serve_engine(args)
    assert engine._host_fields == {"stream_interval": 2, "disable_log_stats": True}


def test_auto_tool_choice_needs_a_parser(capsys) -> None:
    from asyncllm.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--enable-auto-tool-choice"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--tool-call-parser" in err and "qwen3_coder, qwen3_xml, seed_oss" in err


def _subparser(command: str) -> argparse.ArgumentParser:
    actions = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices[command]


def test_serve_runs_the_bundled_model_on_localhost() -> None:
    proc = subprocess.Popen([sys.executable, "-P", "-m", "asyncllm", "serve", "--port", "0",
                             "--max-num-seqs", "4", "--disable-log-stats", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r" on (http://127\.0\.0\.1:(\d+))/v1 once", line_with(proc, "starting: serving"))
        base, port = url[1], int(url[2])  # --port 0: the port the kernel picked, bound before the model loads
        assert port != 0
        wait_healthy(proc, base)
        models = httpx.get(base + "/v1/models").json()
        completion = httpx.post(base + "/v1/completions", json={"model": "asyncllm-tiny", "prompt": "def ",
                                                                "max_tokens": 3, "ignore_eos": True}).json()
        assert [m["id"] for m in models["data"]] == ["asyncllm-tiny"]
        assert completion["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]


def test_cli_reference_lists_every_flag() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    for name in ENGINE_FLAG_FIELDS:
        assert f"`--{name.replace('_', '-')}`" in text, name
    for row in markdown_table().splitlines():  # the rows' text too: regenerate with `python -m asyncllm.cli_args`
        assert row in text, row
    for command in ("generate", "serve", "engine"):
        for action in _subparser(command)._actions:
            for option in action.option_strings:
                if option.startswith("--") and not option.startswith("--no-") and option != "--help":
                    assert f"`{option}" in text, (command, option)


def test_cli_reference_names_every_registered_parser() -> None:
    from pathlib import Path

    from asyncllm.reasoning import REASONING_PARSERS
    from asyncllm.tool_calls import TOOL_PARSERS

    lines = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8").splitlines()
    for flag, registry in (("--tool-call-parser", TOOL_PARSERS), ("--reasoning-parser", REASONING_PARSERS)):
        row = next(line for line in lines if line.startswith(f"| `{flag}` |"))
        assert [name for name in registry if f"`{name}`" not in row] == [], flag


def _serve_args(*flags: str) -> argparse.Namespace:
    return _parser().parse_args(["serve", *flags])


def test_uvicorn_flags_map_to_uvicorn_config() -> None:
    import uvicorn

    from asyncllm.cli_commands import CLOSE_GRACE_S, uvicorn_kwargs

    args = _serve_args("--uds", "/tmp/x.sock", "--root-path", "/llm", "--uvicorn-log-level", "debug",
                       "--disable-uvicorn-access-log", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
                       "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2", "--shutdown-timeout", "5")
    kwargs = uvicorn_kwargs(args)
    assert kwargs == {"uds": "/tmp/x.sock", "log_level": "debug", "access_log": False, "root_path": "/llm",
                      "ssl_keyfile": "k.pem", "ssl_certfile": "c.pem", "ssl_ca_certs": "ca.pem",
                      "ssl_cert_reqs": ssl.CERT_REQUIRED, "timeout_graceful_shutdown": 5.0 + CLOSE_GRACE_S}
    config = uvicorn.Config(None, **kwargs)  # every keyword is one uvicorn takes
    assert (config.uds, config.root_path, config.access_log, config.ssl_cert_reqs) == ("/tmp/x.sock", "/llm",
                                                                                       False, 2)
    assert uvicorn_kwargs(_serve_args("--port", "9", "--log-level", "warning")) == {
        "host": "127.0.0.1", "port": 9, "log_level": "warning", "access_log": True, "root_path": "",
        "ssl_keyfile": None, "ssl_certfile": None, "ssl_ca_certs": None, "ssl_cert_reqs": ssl.CERT_NONE,
        "timeout_graceful_shutdown": 30.0}


@pytest.mark.parametrize("flags,named", [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile"),
    (["--ssl-certfile", "c.pem"], "--ssl-keyfile and --ssl-certfile"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs and --ssl-cert-reqs need"),
    (["--ssl-cert-reqs", "2"], "--ssl-ca-certs and --ssl-cert-reqs need"),
])
def test_tls_flags_uvicorn_would_ignore_or_fail_on_are_refused(capsys, flags, named) -> None:
    from asyncllm.cli_commands import check_tls_args

    parser = _parser()
    with pytest.raises(SystemExit):
        check_tls_args(parser.parse_args(["serve", *flags]), parser)
    assert named in capsys.readouterr().err
    check_tls_args(parser.parse_args(["serve", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
                                      "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2"]), parser)  # whole: fine
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--ssl-cert-reqs", "3"])  # ssl's CERT_* only


def test_uds_keeps_other_files_and_live_servers_and_removes_its_socket(tmp_path, capsys) -> None:
    import socket

    from asyncllm.cli_serve import bound_socket

    path = tmp_path / "serve.sock"
    parser = _parser()
    args = parser.parse_args(["serve", "--uds", str(path)])
    path.write_text("precious")
    with pytest.raises(SystemExit):
        bound_socket(args, parser).__enter__()
    assert path.read_text() == "precious" and "not a socket" in capsys.readouterr().err
    path.unlink()
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen(1)
        with pytest.raises(SystemExit):
            bound_socket(args, parser).__enter__()
        assert path.exists() and "already serves there" in capsys.readouterr().err
    with bound_socket(args, parser) as sock:  # the dead server's socket is removed, ours is bound, then removed
        assert sock.getsockname() == str(path) and path.stat().st_mode & 0o777 == 0o666  # as uvicorn's
    assert not path.exists()


def test_serve_warns_that_any_origin_without_a_key_opens_it_to_web_pages(monkeypatch, capsys) -> None:
    from asyncllm import cli_serve
    from asyncllm.cli_commands import run_serve

    monkeypatch.setattr(cli_serve, "serve_app", lambda *args: None)  # the app is built, nothing served
    monkeypatch.delenv("ASYNCLLM_API_KEY", raising=False)
    parser = _parser()
    warned = []
    for flags in ([], ["--api-key", "k"], ["--allowed-origins", '["https://ui.example"]']):
        run_serve(parser.parse_args(["serve", "--port", "0", *flags]), parser)
        warned.append("warning: no --api-key and CORS allows any origin" in capsys.readouterr().err)
    assert warned == [True, False, False]  # vLLM's default origins ["*"] and no key: any page may read it
    monkeypatch.setenv("ASYNCLLM_API_KEY", "k")
    run_serve(parser.parse_args(["serve", "--port", "0"]), parser)
    assert "warning" not in capsys.readouterr().err


def test_api_key_takes_several_keys_as_vllms_else_the_environments(monkeypatch) -> None:
    from asyncllm.cli_commands import _serve_app

    parser = _parser()
    monkeypatch.setenv("ASYNCLLM_API_KEY", "k3")
    for flags, keys in ((["--api-key", "k1", "k2"], (b"k1", b"k2")), ([], (b"k3",))):
        _, app = _serve_app(parser.parse_args(["serve", *flags]), parser)  # the engine is built, not started
        assert app.state.openai_server._api_keys == keys


def test_serve_labels_metrics_with_the_first_served_name(monkeypatch) -> None:
    from prometheus_client import generate_latest

    from asyncllm.cli_commands import _serve_app
    from asyncllm.integrations.openai_info import served_name

    monkeypatch.setenv("ASYNCLLM_API_KEY", "k")  # no open-CORS warning
    parser = _parser()
    for flags, label in (([], "asyncllm-tiny"), (["--served-model-name", "a", "b"], "a")):
        engine, _ = _serve_app(parser.parse_args(["serve", *flags]), parser)  # the engine is built, not started
        text = generate_latest(engine.metrics_registry).decode()
        assert set(re.findall(r'model_name="([^"]*)"', text)) == {label}  # the bundled model's name, not its folder
    # an engine address is no name: an attached server is labelled with the core's model once attached
    assert served_name("ipc:///tmp/e.sock") is None and served_name("tcp://127.0.0.1:1") is None
