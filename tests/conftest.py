"""Shared fixtures: tiny random checkpoints made locally, and transformers' references."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator

import pytest
from hypothesis import settings

# Worker processes share 2 cores with the test process: keep torch from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tiny test models need a few MB of KV cache; every worker would zero the 1 GiB default at start (~0.6 s).
os.environ.setdefault("ASYNCLLM_CPU_KVCACHE_SPACE_GB", "0.125")
# The suite starts many interpreters (the CLI's, spawned engines' cores and workers): with PYTHONDONTWRITEBYTECODE
# set (as on the 2-CPU CI box) each compiled asyncllm from source again (the suite took 13 min 56 s there, 12 min
# 25 s writing bytecode, one run each). Its test processes and children write bytecode (__pycache__ is git-ignored).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False
# Property tests (hypothesis) draw the same examples on every run, so that a CI run is reproducible (a test may set
# its own `derandomize`: the files reading PROP_EXAMPLES do); PROP_RANDOM=1 draws at random, for hunts.
if not os.environ.get("PROP_RANDOM"):
    settings.register_profile("asyncllm-fixed-draws", derandomize=True)
    settings.load_profile("asyncllm-fixed-draws")


@pytest.fixture(scope="session", autouse=True)
def forkserver() -> Iterator[str]:
    """One fork server per test process (asyncllm/forkserver.py): engine cores and workers start with torch
    imported, about a second less each. ASYNCLLM_TEST_SPAWN=1 runs the suite on new interpreters instead."""
    if os.environ.get("ASYNCLLM_TEST_SPAWN") == "1":
        yield ""
        return
    from asyncllm import forkserver, procutil

    folder = procutil.private_ipc_dir()
    address = os.path.join(folder, "forkserver.sock")
    try:
        server = forkserver.start_server(address)
    except RuntimeError as exc:  # the suite still runs, on new interpreters
        warnings.warn(f"no test fork server: {exc}", stacklevel=1)
        procutil.remove_dir(folder)
        yield ""
        return
    os.environ["ASYNCLLM_FORKSERVER"] = address
    try:
        yield address
    finally:
        os.environ.pop("ASYNCLLM_FORKSERVER", None)
        procutil.stop_process(server)
        procutil.remove_dir(folder)


@pytest.fixture(scope="module", autouse=True)
def spawned_processes(request: pytest.FixtureRequest, forkserver: str) -> Iterator[None]:
    """A module that sets ``SPAWN_PROCESSES = True`` (it checks process trees or command lines) gets its engines'
    processes started as new interpreters, the way users get them."""
    if not (forkserver and getattr(request.module, "SPAWN_PROCESSES", False)):
        yield
        return
    os.environ.pop("ASYNCLLM_FORKSERVER", None)
    try:
        yield
    finally:
        os.environ["ASYNCLLM_FORKSERVER"] = forkserver


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
