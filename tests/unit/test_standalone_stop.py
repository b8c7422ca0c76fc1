"""`asyncllm engine` stopping: a second SIGTERM / Ctrl-C while it stops (its workers' shutdown) is logged, not fatal:
the hosts are still told and the socket removed, and the previous handlers come back only afterwards."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncllm.engine import standalone


class _FakeIO:
    def __init__(self, address: str) -> None:
        self.path = Path(address[len("ipc://"):])
        self.path.touch()  # the socket file a bound CoreIO leaves
        self.sent: list[tuple[bytes, object]] = []

    def send(self, client_id: bytes, message: object) -> None:
        self.sent.append((client_id, message))

    def close(self) -> None:
        pass


class _FakeCore:
    """Stopped at once; its shutdown takes a second SIGTERM, as a user pressing on while the workers stop."""

    def __init__(self, config: object, io: _FakeIO, hf_config_json: object, auto_fit: bool, model_name: str) -> None:
        self.io, self.clients, self.stops, self.model_name = io, [b"host-1"], 0, model_name

    def run(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    def stop(self) -> None:
        self.stops += 1

    def shutdown(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def fake_core(monkeypatch):
    cores: list[_FakeCore] = []

    def make(*args: object) -> _FakeCore:
        cores.append(_FakeCore(*args))
        return cores[-1]

    config = SimpleNamespace(data_parallel_size=1, max_model_len=128, model="acme/tiny")
    monkeypatch.setattr(standalone, "prepare", lambda config, decodes_images: SimpleNamespace(
        config=config, hf_config_json=None))
    monkeypatch.setattr(standalone, "CoreIO", _FakeIO)
    monkeypatch.setattr(standalone, "EngineCore", make)
    monkeypatch.setattr(standalone, "configure_child_logging", lambda tag: None)
    monkeypatch.setattr(standalone, "report_crashes", lambda: None)
    return config, cores


def test_a_second_signal_while_stopping_is_logged_and_the_socket_removed(fake_core, tmp_path, caplog) -> None:
    config, cores = fake_core
    outside: list[int] = []

    def before(signum: int, frame: object) -> None:  # what the process had: here it only records
        outside.append(signum)

    previous = {sig: signal.signal(sig, before) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        caplog.set_level("INFO", logger="asyncllm.engine.core")
        standalone.run_standalone_core(config, f"ipc://{tmp_path}/e.sock")
        assert outside == []  # neither signal reached the handlers from before
        assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is before
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    core = cores[0]
    assert core.stops == 2 and not (tmp_path / "e.sock").exists()
    assert [client for client, _ in core.io.sent] == [b"host-1"]  # the host was told
    assert "received SIGTERM while stopping" in caplog.text


def test_once_stopped_the_cli_ignores_a_repeat_during_the_interpreters_exit(monkeypatch) -> None:
    """Python's handlers are gone for the last second of teardown (torch's): only SIG_IGN keeps exit code 0."""
    from asyncllm.cli import _parser
    from asyncllm.cli_commands import run_engine

    monkeypatch.setattr(standalone, "run_standalone_core", lambda config, address, on_ready: None)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    parser = _parser()
    try:
        run_engine(parser.parse_args(["engine", "--disable-log-stats"]), parser)
        assert [signal.getsignal(sig) for sig in previous] == [signal.SIG_IGN, signal.SIG_IGN]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_sigterm_while_the_model_loads_removes_the_socket(fake_core, monkeypatch, tmp_path) -> None:
    """A service stopped while its core loads (systemd, ``docker stop``): the start's cleanup runs, as for Ctrl-C,
    and the exit status is SIGTERM's; the default action ended the process at once, its socket file left behind
    (and the workers' folder and ring)."""
    import time

    config, _ = fake_core

    def loading(*args: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the model loads: the signal's handler runs here
        raise AssertionError("never loaded")

    monkeypatch.setattr(standalone, "EngineCore", loading)
    outside: list[int] = []

    def default(signum: int, frame: object) -> None:  # the process's handler (SIG_DFL's would end the test run)
        outside.append(signum)

    before = signal.signal(signal.SIGTERM, default)
    try:
        with pytest.raises(SystemExit) as exit_info:
            standalone.run_standalone_core(config, f"ipc://{tmp_path}/e.sock")
        assert signal.getsignal(signal.SIGTERM) is default
    finally:
        signal.signal(signal.SIGTERM, before)
    assert outside == [] and exit_info.value.code == 128 + signal.SIGTERM and not (tmp_path / "e.sock").exists()
