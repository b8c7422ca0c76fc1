"""The engine core's and workers' own logging: ASYNCLLM_LOGGING_LEVEL, ASYNCLLM_CONFIGURE_LOGGING, and the host's
`asyncllm` level passed on to them (asyncllm/child_logging.py)."""

from __future__ import annotations

import logging

import pytest

from asyncllm.child_logging import configure_child_logging, host_logging_env
from asyncllm.errors import ConfigError


@pytest.fixture
def asyncllm_logger(monkeypatch: pytest.MonkeyPatch) -> logging.Logger:
    """The `asyncllm` logger, its handlers and level restored afterwards; neither variable set."""
    logger = logging.getLogger("asyncllm")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.delenv("ASYNCLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("ASYNCLLM_CONFIGURE_LOGGING", raising=False)
    return logger


def test_the_hosts_asyncllm_level_is_passed_on_unless_the_variable_says_otherwise(asyncllm_logger, monkeypatch):
    assert host_logging_env() == {}  # the host set no level: the children's default (INFO)
    asyncllm_logger.setLevel(logging.ERROR)
    assert host_logging_env() == {"ASYNCLLM_LOGGING_LEVEL": "40"}
    monkeypatch.setenv("ASYNCLLM_LOGGING_LEVEL", "debug")
    assert host_logging_env() == {}  # the child reads the variable itself
    monkeypatch.setenv("ASYNCLLM_LOGGING_LEVEL", "loud")
    with pytest.raises(ConfigError, match="ASYNCLLM_LOGGING_LEVEL"):
        host_logging_env()


def test_a_child_logs_to_stderr_at_the_level_asked_or_not_at_all(asyncllm_logger, monkeypatch):
    monkeypatch.setenv("ASYNCLLM_CONFIGURE_LOGGING", "0")
    configure_child_logging("core")
    assert asyncllm_logger.handlers == [] and asyncllm_logger.level == logging.NOTSET
    monkeypatch.setenv("ASYNCLLM_CONFIGURE_LOGGING", "1")
    configure_child_logging("core")
    assert asyncllm_logger.level == logging.INFO
    monkeypatch.setenv("ASYNCLLM_LOGGING_LEVEL", "40")
    configure_child_logging("worker 1")
    [handler] = asyncllm_logger.handlers
    assert asyncllm_logger.level == logging.ERROR and "[core]" in handler.formatter._fmt
