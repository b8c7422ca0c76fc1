"""asyncllm: an asyncio-native LLM inference engine to embed in Python apps.

``import asyncllm`` is cheap and never initialises CUDA: every public name
(`__all__`) is imported on first use (`_HOMES`), and so is a submodule read as an
attribute (``asyncllm.errors`` after a bare ``import asyncllm``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
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
        RequestTimeoutError,
    )
    from asyncllm.lora import LoRARequest
    from asyncllm.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput, StreamDelta
    from asyncllm.pooling import ClassificationOutput, EmbeddingOutput, PoolingParams, ScoringOutput
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
    "EngineDeadError",
    "EventLoopError",
]


_HOMES = {
    "AsyncEngine": "asyncllm.engine.async_engine", "EngineConfig": "asyncllm.config",
    **dict.fromkeys(("SamplingParams", "RequestOutputKind", "StructuredOutputs"), "asyncllm.sampling"),
    "LoRARequest": "asyncllm.lora",
    **dict.fromkeys(("BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"), "asyncllm.beam_search"),
    **dict.fromkeys(("PoolingParams", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput"), "asyncllm.pooling"),
    **dict.fromkeys(("StreamDelta", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "EngineStats"),
                    "asyncllm.outputs"),
    **dict.fromkeys(("AsyncLLMError", "ConfigError", "NotBuiltError", "InvalidRequestError", "EngineOverloadedError",
                     "RequestTimeoutError", "EngineDeadError", "EventLoopError"), "asyncllm.errors"),
}
"""Where each public name lives: imported on first use, so that ``import asyncllm`` imports nothing more (a
command's Ctrl-C while it imports is its own: asyncllm/__main__.py)."""


def _checkout_root() -> list[str]:
    """The source checkout this package is imported from (``[]`` for an installed one): its root holds the
    subpackages pyproject's package-dir maps (workers/, kernels/, integrations/: asyncllm.workers, ...), so a
    script or server run from the root, whose ./asyncllm shadows the installed package, still finds them."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as pyproject:
            names_us = 'name = "asyncllm"' in pyproject.read()
    except OSError:
        return []
    return [root] if names_us and os.path.isdir(os.path.join(root, "workers")) else []


__path__ += _checkout_root()


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
