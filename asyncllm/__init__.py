"""asyncllm: an asyncio-native LLM inference engine to embed in Python apps.

``import asyncllm`` is cheap and never initialises CUDA: every public name
(`__all__`) is imported on first use (`_HOMES`), and so is a submodule read as an
attribute (``asyncllm.errors`` after a bare ``import asyncllm``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from asyncllm.config import EngineConfig
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.errors import (
        AsyncLLMError,
        ConfigError,
        EngineDeadError,
        EngineOverloadedError,
        EventLoopError,
        InvalidRequestError,
        NotBuiltError,
        RequestAbortedError,
        RequestTimeoutError,
    )
    from asyncllm.lora import LoRARequest
    from asyncllm.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput, StreamDelta
    from asyncllm.pooling import ClassificationOutput, EmbeddingOutput, PoolingOutput, PoolingParams, ScoringOutput
    from asyncllm.sampling import RequestOutputKind, SamplingParams, StructuredOutputs

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputs",
    "LoRARequest",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "PoolingParams",
    "EmbeddingOutput",
    "ClassificationOutput",
    "ScoringOutput",
    "PoolingOutput",
    "StreamDelta",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "EngineStats",
    "AsyncLLMError",
    "ConfigError",
    "NotBuiltError",
    "InvalidRequestError",
    "EngineOverloadedError",
    "RequestTimeoutError",
    "RequestAbortedError",
    "EngineDeadError",
    "EventLoopError",
]


_HOMES = {
    "AsyncEngine": "asyncllm.engine.async_engine", "EngineConfig": "asyncllm.config",
    **dict.fromkeys(("SamplingParams", "RequestOutputKind", "StructuredOutputs"), "asyncllm.sampling"),
    "LoRARequest": "asyncllm.lora",
    **dict.fromkeys(("BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"), "asyncllm.beam_search"),
    **dict.fromkeys(("PoolingParams", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput", "PoolingOutput"),
                    "asyncllm.pooling"),
    **dict.fromkeys(("StreamDelta", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "EngineStats"),
                    "asyncllm.outputs"),
    **dict.fromkeys(("AsyncLLMError", "ConfigError", "NotBuiltError", "InvalidRequestError", "EngineOverloadedError",
                     "RequestTimeoutError", "RequestAbortedError", "EngineDeadError", "EventLoopError"),
                    "asyncllm.errors"),
}
"""Where each public name lives: imported on first use, so that ``import asyncllm`` imports nothing more (a
command's Ctrl-C while it imports is its own: asyncllm/__main__.py)."""


_MAPPED = ("workers", "kernels", "integrations")
"""asyncllm.<name> packages whose folders pyproject's package-dir maps from the checkout root."""


class _CheckoutFinder:
    """Finds asyncllm.workers, .kernels and .integrations in the source checkout this package is imported from (a
    script or server run from its root, whose ./asyncllm shadows an installed package, or an editable install):
    those three folders only, not the root's others (tests/, docs/, asyncllm/ itself)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        package, _, sub = name.partition(".")
        if package != __name__ or sub not in _MAPPED:
            return None
        folder = os.path.join(self.root, sub)
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def _checkout_root() -> str | None:
    """The root of the source checkout this package is imported from: its pyproject.toml's [project] names asyncllm
    and the mapped folders lie beside it (None for an installed package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as pyproject:
            text = pyproject.read()
    except OSError:
        return None
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    names_us = project is not None and re.search(r'^name\s*=\s*"asyncllm"\s*$', project[1], re.M) is not None
    mapped = all(os.path.isfile(os.path.join(root, sub, "__init__.py")) for sub in _MAPPED)
    return root if names_us and mapped else None


if (_root := _checkout_root()) is not None:
    sys.meta_path.insert(0, _CheckoutFinder(_root))


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        if name.isidentifier() and not name.startswith("__") and importlib.util.find_spec(f"asyncllm.{name}"):
            return importlib.import_module(f"asyncllm.{name}")  # (found without importing it or anything else)
        raise AttributeError(f"module 'asyncllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
