"""Shared fixtures: tiny random checkpoints made locally, and transformers' references."""

from __future__ import annotations

import os

import pytest

# Worker processes share 2 cores with the test process: keep torch from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tiny test models need a few MB of KV cache; every worker would zero the 1 GiB default at start (~0.6 s).
os.environ.setdefault("ASYNCLLM_CPU_KVCACHE_SPACE_GB", "0.125")


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
