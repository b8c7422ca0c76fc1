"""Shared fixtures: tiny random checkpoints made locally, and transformers' references."""

from __future__ import annotations

import os

import pytest

# Worker processes share 2 cores with the test process: keep torch from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_llama() -> str:
    from asyncllm.tiny import tiny_checkpoint

    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> str:
    from asyncllm.tiny import tiny_checkpoint

    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3() -> str:
    from asyncllm.tiny import tiny_checkpoint

    return tiny_checkpoint("qwen3")
