"""Logging of asyncllm's own processes (the engine core, its workers), as the host asks for it.

The children log `asyncllm` records to their stderr, inherited from the host, with their own handler (the host's
handlers are not in their interpreter). vLLM's two switches, read by each child from the environment it inherits:
``ASYNCLLM_LOGGING_LEVEL`` (VLLM_LOGGING_LEVEL) and ``ASYNCLLM_CONFIGURE_LOGGING=0`` (VLLM_CONFIGURE_LOGGING: no
handler and no level set, Python's last-resort WARNING lines only). Without ``ASYNCLLM_LOGGING_LEVEL`` a host that
set the level of its ``asyncllm`` logger gives the children that level (`host_logging_env`).
"""

from __future__ import annotations

import logging
import os
import sys

from asyncllm import envs

__all__ = ["configure_child_logging", "host_logging_env", "log_to_stderr"]


def host_logging_env() -> dict[str, str]:
    """What a child's environment adds so that it logs as the host asked: the level the host set on its
    ``asyncllm`` logger, unless ``ASYNCLLM_LOGGING_LEVEL`` says otherwise. Checks both variables here, so that a bad
    value is the host's `ConfigError` rather than a child that fails to start."""
    envs.CONFIGURE_LOGGING.get()
    envs.LOGGING_LEVEL.get()
    level = logging.getLogger("asyncllm").level
    if os.environ.get(envs.LOGGING_LEVEL.name) or level == logging.NOTSET:
        return {}
    return {envs.LOGGING_LEVEL.name: str(level)}


def configure_child_logging(tag: str) -> None:
    """Send this process's `asyncllm` records at ``ASYNCLLM_LOGGING_LEVEL`` and above to stderr, each line tagged
    `tag` (``core``, ``worker 0``); nothing with ``ASYNCLLM_CONFIGURE_LOGGING=0``."""
    log_to_stderr(logging.getLogger("asyncllm"), tag)


def log_to_stderr(logger: logging.Logger, tag: str = "", *, unless_configured: bool = False) -> None:
    """Send `logger`'s records at ``ASYNCLLM_LOGGING_LEVEL`` (INFO) and above to stderr, each line tagged `tag` if
    given; nothing with ``ASYNCLLM_CONFIGURE_LOGGING=0``. A handler already on `logger` is kept (no second one);
    `unless_configured`: nothing either when logging is configured (a handler on `logger` or above: the host's)."""
    if unless_configured and logger.hasHandlers() or not envs.CONFIGURE_LOGGING.get():
        return
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        tagged = f"[{tag}] " if tag else ""
        handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s {tagged}%(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(envs.LOGGING_LEVEL.get())
