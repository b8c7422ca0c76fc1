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

__all__ = ["configure_child_logging", "host_logging_env"]


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
    if not envs.CONFIGURE_LOGGING.get():
        return
    root = logging.getLogger("asyncllm")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s [{tag}] %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(envs.LOGGING_LEVEL.get())
