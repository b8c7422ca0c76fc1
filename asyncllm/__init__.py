"""asyncllm: an asyncio-native LLM inference engine to embed in Python apps.

``import asyncllm`` is cheap and never initialises CUDA: the engine classes
are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncllm.config import EngineConfig
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
from asyncllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from asyncllm.lora import LoRARequest
from asyncllm.pooling import ClassificationOutput, EmbeddingOutput, PoolingParams, ScoringOutput
from asyncllm.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput, StreamDelta
from asyncllm.sampling import RequestOutputKind, SamplingParams, StructuredOutputs

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine

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


def __getattr__(name: str) -> Any:
    if name == "AsyncEngine":
        from asyncllm.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'asyncllm' has no attribute {name!r}")
