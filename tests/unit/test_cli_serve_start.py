"""`asyncllm serve` binds its socket first and starts the engine before the server (asyncllm/cli_serve.py): a port in
use and a bad engine config are one line and exit 2 before anything loads or serves."""

from __future__ import annotations

import os
import signal
import socket
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
import uvicorn
from starlette.applications import Starlette

from asyncllm import cli_commands, cli_serve
from asyncllm.cli import _parser, main
from asyncllm.errors import ConfigError, EngineDeadError, InvalidRequestError
from asyncllm.integrations.openai_lora import LoRAModels, LoRAModule, start_server


class _Engine:
    """An engine whose start raises `error` (None: starts)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error, self.calls = error, []

    async def start(self) -> None:
        self.calls.append("start")
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.calls.append("aclose")

    async def add_lora(self, request: object) -> None:
        self.calls.append("add_lora")
        if self.error is None and "bad" in request.lora_path:
            raise InvalidRequestError("lora_path", "no adapter folder there")


def _openai_app(engine: _Engine, lora_path: str) -> Starlette:
    """An app whose startup checks one LoRA module at `lora_path` (`start_server`)."""
    app = Starlette()
    app.state.openai_server = SimpleNamespace(engine=engine, model_names=["m"],
                                              loras=LoRAModels([LoRAModule("sql", lora_path)], ["m"]))
    return app


async def _app(scope, receive, send) -> None:
    raise AssertionError("nothing is served")


def test_a_port_in_use_is_one_line_before_the_model_is_looked_up(monkeypatch, capsys) -> None:
    def no_model(config: object) -> None:
        raise AssertionError("the model was looked up")

    monkeypatch.setattr(cli_commands, "check_model", no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--port", str(port)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"asyncllm: error: cannot bind --host 127.0.0.1 --port {port}: Address already in use" in err


@pytest.mark.parametrize("error, code, said", [
    (ConfigError("device", "cuda", "'cpu' or 'auto': no CUDA device is visible to the worker"), 2,
     "asyncllm: error: device='cuda' is not allowed: 'cpu' or 'auto': no CUDA device is visible to the worker\n"),
    (EngineDeadError("worker rank 0 failed: killed"), "asyncllm serve: EngineDeadError: worker rank 0 failed: killed",
     ""),  # exit 1, its line printed by sys.exit
    (KeyboardInterrupt(), 130, ""),  # Ctrl-C while the model loads
])
def test_a_failed_engine_start_is_one_line_before_the_server_starts(monkeypatch, capsys, error, code, said) -> None:
    async def no_serve(self, sockets=None) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(uvicorn.Server, "serve", no_serve)
    parser, engine = _parser(), _Engine(error)
    args = parser.parse_args(["serve", "--port", "0"])
    with cli_serve.bound_socket(args, parser) as sock, pytest.raises(SystemExit) as exit_info:
        cli_serve.serve_app(_app, engine, sock, args, parser)
    err = capsys.readouterr().err
    assert exit_info.value.code == code and engine.calls == ["start", "aclose"]
    assert err.endswith(said) and "Traceback" not in err


def test_the_engine_starts_then_the_server_serves_on_the_bound_socket(monkeypatch, capsys) -> None:
    served = []

    async def serve(self, sockets=None) -> None:
        served.append((list(engine.calls), sockets))
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "serve", serve)
    parser, engine = _parser(), _Engine()
    args = parser.parse_args(["serve", "--port", "0"])
    with cli_serve.bound_socket(args, parser) as sock:
        cli_serve.serve_app(_app, engine, sock, args, parser)
        port = sock.getsockname()[1]
    assert served == [(["start"], [sock])] and port != 0 and sock.fileno() == -1  # closed when serve ends
    assert f"serving the bundled tiny model (no MODEL given) on http://127.0.0.1:{port}/v1 once the model is loaded" \
        in capsys.readouterr().err


def test_a_bad_lora_module_is_one_line_before_the_server_starts_and_is_checked_once(monkeypatch, capsys) -> None:
    async def serve(self, sockets=None) -> None:
        await start_server(self.config.app.app.state.openai_server)  # the lifespan's run (the app in its RequestGate)
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "serve", serve)
    parser = _parser()
    args = parser.parse_args(["serve", "--port", "0"])
    bad, good = _Engine(), _Engine()
    with cli_serve.bound_socket(args, parser) as sock:
        with pytest.raises(SystemExit) as exit_info:
            cli_serve.serve_app(_openai_app(bad, "/bad"), bad, sock, args, parser)
        err = capsys.readouterr().err
        cli_serve.serve_app(_openai_app(good, "/good"), good, sock, args, parser)
    assert exit_info.value.code == 2 and bad.calls == ["start", "add_lora", "aclose"]
    assert err.endswith("asyncllm: error: lora_modules='sql=/bad' is not allowed: no adapter folder there\n")
    assert good.calls == ["start", "add_lora", "start"]  # the modules checked once (a started engine's start returns)


def test_a_failed_lifespan_startup_is_uvicorn_runs_exit_3(capsys) -> None:
    @asynccontextmanager
    async def lifespan(app):
        raise RuntimeError("the app could not start")
        yield

    async def unstarted(self, sockets=None) -> None:
        """An uvicorn whose `Server.startup` returns on a failed lifespan (0.54's calls sys.exit(3) itself)."""

    parser = _parser()
    args = parser.parse_args(["serve", "--port", "0"])
    for patch in (None, unstarted):
        engine = _Engine()
        with pytest.MonkeyPatch.context() as monkeypatch:
            if patch is not None:
                monkeypatch.setattr(uvicorn.Server, "serve", patch)
            with cli_serve.bound_socket(args, parser) as sock, pytest.raises(SystemExit) as exit_info:
                cli_serve.serve_app(Starlette(lifespan=lifespan), engine, sock, args, parser)
        assert exit_info.value.code == 3 and engine.calls == ["start"]


def test_sigterm_after_serving_removes_the_uds_socket_before_the_signal_ends_the_process(monkeypatch, tmp_path):
    raised = []

    async def serve(self, sockets=None) -> None:  # uvicorn's: shut down, then re-raise SIGTERM to the prior handler
        self.started = True
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

    monkeypatch.setattr(uvicorn.Server, "serve", serve)
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    parser, path = _parser(), str(tmp_path / "s.sock")
    args = parser.parse_args(["serve", "--uds", path])
    before = signal.getsignal(signal.SIGTERM)
    with cli_serve.bound_socket(args, parser) as sock:
        cli_serve.serve_app(_app, _Engine(), sock, args, parser)
        assert raised == [signal.SIGTERM] and not os.path.exists(path)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("host, reaches", [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"),
                                           ("", "127.0.0.1"), ("::1", "::1"), ("::", "127.0.0.1")])
def test_the_socket_is_bound_as_vllms_create_server_socket(host, reaches) -> None:
    if ":" in host and not _has_ipv6():
        pytest.skip("no IPv6 loopback here")
    with cli_serve._bind_tcp(host, 0) as sock:
        sock.listen()
        port = sock.getsockname()[1]
        socket.create_connection((reaches, port), timeout=2).close()  # the kernel queues it on the listening socket
        shown = cli_serve.listen_url(SimpleNamespace(uds=None, host=host, ssl_certfile=None), sock)
    url_host = {"": "0.0.0.0", "::1": "[::1]", "::": "[::]"}.get(host, host)
    assert shown == f"http://{url_host}:{port}/v1"


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("trust", [False, True])
def test_check_model_downloads_the_code_a_trusted_model_needs(monkeypatch, trust: bool) -> None:
    from asyncllm.models import checkpoint

    calls = []
    monkeypatch.setattr(checkpoint, "resolve_model_path", lambda *args, **kwargs: calls.append(kwargs) or "/nowhere")
    config = SimpleNamespace(model="org/model", revision=None, download_dir=None, load_format="auto",
                             trust_remote_code=trust, generation_config="vllm")
    cli_commands.check_model(config)
    assert [call["trust_remote_code"] for call in calls] == [trust]
