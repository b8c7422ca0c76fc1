"""`asyncllm serve` prints the periodic stats line on stderr, as vLLM's serve does (docs/cli.md,
--disable-log-stats), unless the process's logging is configured or ASYNCLLM_CONFIGURE_LOGGING=0."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest

import asyncllm.cli_serve
from asyncllm.cli import _parser
from asyncllm.cli_commands import log_stats, run_serve
from asyncllm.engine.stats_log import logger as stats_logger


@pytest.fixture
def unconfigured(monkeypatch):
    """The stats logger as in a fresh `asyncllm serve` process: no handler on it or above (pytest's own root
    handlers are cut off), its handlers and level restored afterwards."""
    monkeypatch.delenv("ASYNCLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.delenv("ASYNCLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(stats_logger, "propagate", False)
    handlers, level = list(stats_logger.handlers), stats_logger.level
    stats_logger.handlers.clear()
    yield
    stats_logger.handlers[:] = handlers
    stats_logger.setLevel(level)


def _printed(capsys, **config) -> str:
    log_stats(SimpleNamespace(**config))
    stats_logger.info("Avg prompt throughput: 1.0 tokens/s")
    return capsys.readouterr().err


def test_the_stats_line_goes_to_stderr(unconfigured, capsys) -> None:
    assert "asyncllm.engine.stats: Avg prompt throughput: 1.0 tokens/s" in _printed(capsys, disable_log_stats=False)
    log_stats(SimpleNamespace(disable_log_stats=False))  # configured now: no second handler
    assert len(stats_logger.handlers) == 1


@pytest.mark.parametrize("flags, handlers", [([], 1), (["--disable-log-stats"], 0)])
def test_serve_sets_it_up(unconfigured, monkeypatch, flags, handlers) -> None:
    monkeypatch.setattr(asyncllm.cli_serve, "bound_socket", lambda args, parser: contextlib.nullcontext())
    monkeypatch.setattr(asyncllm.cli_serve, "serve_app", lambda *args: None)  # the engine is built, not started
    monkeypatch.setenv("ASYNCLLM_API_KEY", "k")  # no open-CORS warning
    parser = _parser()
    run_serve(parser.parse_args(["serve", *flags]), parser)
    assert len(stats_logger.handlers) == handlers


def test_disable_log_stats_adds_no_handler(unconfigured) -> None:
    log_stats(SimpleNamespace(disable_log_stats=True))
    assert stats_logger.handlers == []


def test_configure_logging_0_leaves_logging_to_the_host(unconfigured, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCLLM_CONFIGURE_LOGGING", "0")
    log_stats(SimpleNamespace(disable_log_stats=False))
    assert stats_logger.handlers == []


def test_a_configured_process_keeps_its_own_handlers(unconfigured) -> None:
    parent = logging.getLogger("asyncllm.engine")
    handler = logging.NullHandler()
    parent.addHandler(handler)
    stats_logger.propagate = True
    try:
        log_stats(SimpleNamespace(disable_log_stats=False))
        assert stats_logger.handlers == []
    finally:
        parent.removeHandler(handler)


def test_asyncllm_logging_level_sets_its_level(unconfigured, monkeypatch, capsys) -> None:
    monkeypatch.setenv("ASYNCLLM_LOGGING_LEVEL", "WARNING")
    assert _printed(capsys, disable_log_stats=False) == ""
