"""What the engine hands back: stream deltas, final outputs, per-request timing."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StreamDelta", "CompletionOutput", "RequestOutput", "RequestMetrics"]


@dataclass(slots=True)
class StreamDelta:
    """New text and tokens of one sample since the previous delta of the stream.

    When the consumer is slower than the engine, consecutive deltas are merged,
    so one delta may carry several tokens.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """None while running; then 'stop', 'length' or 'abort'."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the sample, if any."""
    logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life, and derived latencies."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None


@dataclass(slots=True)
class RequestOutput:
    """The final result of `AsyncEngine.generate`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list | None:
        return self.outputs[0].logprobs


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (see `AsyncEngine.stats`)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_gpu_blocks: int = 0
    num_used_blocks: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    engine_alive: bool = True
    extra: dict = field(default_factory=dict)
