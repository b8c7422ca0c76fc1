"""The public surface: one __all__, a cheap import that never touches torch."""

from __future__ import annotations

import subprocess
import sys

import asyncllm
from asyncllm import errors


def test_all_names_resolve() -> None:
    for name in asyncllm.__all__:
        assert getattr(asyncllm, name) is not None, name
    assert asyncllm.AsyncEngine.__module__ == "asyncllm.engine.async_engine"


def test_import_is_cheap_and_cuda_free() -> None:
    code = "import sys, asyncllm; print(sorted(m for m in ('torch', 'transformers', 'zmq') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_engine_class_import_leaves_torch_to_start() -> None:
    """`from asyncllm import AsyncEngine` at an app's module level does not import torch or the model classes:
    `start()` prepares the engine on a worker thread (transformers' tokenizer brings torch there, off the loop)."""
    code = ("import sys; from asyncllm import AsyncEngine\n"
            "print(sorted(m for m in ('torch', 'transformers', 'asyncllm.models.registry') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_error_tree() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.AsyncLLMError)
    assert issubclass(errors.NotBuiltError, errors.ConfigError)
    assert errors.InvalidRequestError("temperature", "bad").field == "temperature"
