"""One OpenTelemetry span per request (an n > 1 request: one per sample, as vLLM's V1 one per child request), from
the tracer provider the host set.

The engine never installs a provider or an exporter: spans come from
``opentelemetry.trace.get_tracer("asyncllm")``, which is a no-op until the
host sets its provider (``asyncllm serve --otlp-traces-endpoint``, asyncllm's own
process, sets one: asyncllm/cli_tracing.py). The caller's context is captured on its task as its
`RequestStream` is made (the processor thread has none), so the span is a child
of the span current where `stream()` / `generate()` / `chat()` was called,
wherever the stream is iterated. Spans are started, annotated and ended on the
processor thread (OpenTelemetry is thread-safe; `RequestObserver` logs and skips
a span call the host's provider makes raise). Without
opentelemetry-api installed, `capture_context` returns None and no
`RequestTracer` is made: the whole feature costs one None check per call site.

Attributes follow the gen_ai semantic conventions; asyncllm's own timing
goes under ``asyncllm.*``, and each figure vLLM's ``llm_request`` span carries is
also set under vLLM's name (``gen_ai.request.id``, ``gen_ai.usage.prompt_tokens``,
``gen_ai.latency.time_in_queue``, ...: `VLLM_LATENCY`), so trace queries written
for vLLM find them. Events: queued, scheduled, preempted, first_token,
finished. A cancelled request ends with status ERROR "cancelled"; a failed
one with status ERROR and the exception recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from asyncllm.outputs import RequestMetrics
from asyncllm.protocol import EngineCoreEvent, EngineCoreEventType
from asyncllm.sampling import SamplingParams

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate as otel_propagate
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # opentelemetry-api is optional (the `tracing` extra)
    otel_trace = None

__all__ = ["RequestTracer", "capture_context", "remote_parent", "span_operation", "tracing_available"]

_EVENT_NAMES = {
    EngineCoreEventType.QUEUED: "queued",
    EngineCoreEventType.SCHEDULED: "scheduled",
    EngineCoreEventType.PREEMPTED: "preempted",
}


VLLM_LATENCY = {
    "asyncllm.latency.queue": "gen_ai.latency.time_in_queue",
    "asyncllm.latency.time_to_first_token": "gen_ai.latency.time_to_first_token",
    "asyncllm.latency.prefill": "gen_ai.latency.time_in_model_prefill",
    "asyncllm.latency.decode": "gen_ai.latency.time_in_model_decode",
    "asyncllm.latency.inference": "gen_ai.latency.time_in_model_inference",
    "asyncllm.latency.e2e": "gen_ai.latency.e2e",
}
"""Our latency attributes and vLLM's names for the same figures (vLLM's ``SpanAttributes``), both set."""


def tracing_available() -> bool:
    return otel_trace is not None


def capture_context() -> Any:
    """The caller's current OpenTelemetry context (call it on the caller's task); None without OTel."""
    return None if otel_trace is None else otel_context.get_current()


@contextlib.contextmanager
def remote_parent(headers: Mapping[str, str]) -> Iterator[None]:
    """Inside, the current context is the caller's from an HTTP request's `headers` (W3C ``traceparent``, or the
    propagators the host set: ``opentelemetry.propagate``), as vLLM's server extracts it: requests made there
    get their span under the caller's. What the headers do not carry stays as it was (the host's baggage; with no
    trace header, its current span: an instrumented ASGI server's), and a current span of the header's own trace
    (the server span that instrumentation starts under it) stays the parent. Nothing is read until the host sets a
    tracer provider."""
    if otel_trace is None or isinstance(otel_trace.get_tracer_provider(), otel_trace.ProxyTracerProvider):
        yield
        return
    current = otel_context.get_current()
    extracted = otel_propagate.extract(headers, context=current)
    if extracted is current:  # no trace header, nor baggage
        yield
        return
    span = otel_trace.get_current_span(current)
    if _in_trace_of(span, extracted):
        extracted = otel_trace.set_span_in_context(span, extracted)
    token = otel_context.attach(extracted)
    try:
        yield
    finally:
        otel_context.detach(token)


def _in_trace_of(span: Any, extracted: Any) -> bool:
    """Whether `span` is a local span of the trace the headers put in `extracted`."""
    here, there = span.get_span_context(), otel_trace.get_current_span(extracted).get_span_context()
    return here.is_valid and not here.is_remote and here.trace_id == there.trace_id


def span_operation(chat: bool, pooled: bool) -> str:
    """The request's gen_ai operation name: ``embeddings`` for a pooling request (embed, classify, score)."""
    return "embeddings" if pooled else "chat" if chat else "text_completion"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Starts, annotates and ends request spans; build it only when `tracing_available()`."""

    def __init__(self, model_name: str) -> None:
        from asyncllm import __version__

        assert otel_trace is not None
        self.model_name = model_name
        self._tracer = otel_trace.get_tracer("asyncllm", __version__)

    def start(self, request_id: str, params: SamplingParams, operation: str, num_prompt_tokens: int,
              context: Any, arrival_time: float, sample_index: int | None = None,
              max_tokens: int | None = None) -> Any:
        """A recording span, or None when the host set no tracer provider (nothing more to pay); `operation`:
        `span_operation`'s; `sample_index`: the span of that sample of an n > 1 request (vLLM's child request's);
        `max_tokens`: the request's as vLLM's server sets it (an unset one: max_model_len - the prompt's tokens;
        None: `params.max_tokens`)."""
        span = self._tracer.start_span(
            f"{operation} {self.model_name}", context=context, kind=SpanKind.INTERNAL, start_time=_ns(arrival_time),
            attributes=self._request_attributes(operation, request_id, params, sample_index, max_tokens),
        )
        if not span.is_recording():
            return None
        if num_prompt_tokens:
            span.set_attributes({"gen_ai.usage.input_tokens": num_prompt_tokens,
                                 "gen_ai.usage.prompt_tokens": num_prompt_tokens})  # vLLM's name
        return span

    def _request_attributes(self, operation: str, request_id: str, params: SamplingParams,
                            sample_index: int | None, max_tokens: int | None = None) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "asyncllm",
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.id": request_id,
            "gen_ai.request.id": request_id,  # vLLM's name
        }
        if operation == "embeddings":
            return attributes  # its sampling parameters are the pooling path's own, not the caller's
        if sample_index is not None:  # vLLM's child request: the sample's own parameters (n = 1, its seed)
            attributes |= {"asyncllm.request.sample_index": sample_index, "gen_ai.request.choice.count": params.n}
            params = params.for_sample(sample_index)
        attributes |= {
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,  # vLLM's
        }
        max_tokens = params.max_tokens if max_tokens is None else max_tokens
        if max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = max_tokens
        if params.top_k > 0:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if params.n != 1:
            attributes["gen_ai.request.choice.count"] = params.n
        if params.stop:
            attributes["gen_ai.request.stop_sequences"] = list(params.stop)
        return attributes

    @staticmethod
    def add_core_events(span: Any, events: list[EngineCoreEvent]) -> None:
        for event in events:
            span.add_event(_EVENT_NAMES[event.type], timestamp=_ns(event.timestamp))

    @staticmethod
    def first_token(span: Any, now: float) -> None:
        span.add_event("first_token", timestamp=_ns(now))

    @staticmethod
    def finish(span: Any, metrics: RequestMetrics, finish_reasons: list[str], num_cached_tokens: int,
               now: float, pooled: bool = False) -> None:
        """End the span of a request whose samples all finished, or of one sample of an n > 1 request (status ERROR
        "cancelled" if one was aborted); a pooling request's (`pooled`) has no output tokens and no decode time."""
        span.set_attributes(_timing_attributes(metrics, num_cached_tokens, pooled))
        span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
        span.add_event("finished", {"finish_reason": finish_reasons[-1]}, timestamp=_ns(now))
        if "abort" in finish_reasons:
            _set_cancelled(span)
        span.end(end_time=_ns(now))

    @staticmethod
    def cancel(span: Any, metrics: RequestMetrics, finish_reasons: list[str], now: float) -> None:
        """End the span of a request (or of an n > 1 request's sample) its caller left, or the engine closed, before
        it finished: `finish_reasons`, the samples' that finished and "abort"."""
        span.set_attributes(_timing_attributes(metrics, None))
        span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
        span.add_event("finished", {"finish_reason": "abort"}, timestamp=_ns(now))
        _set_cancelled(span)
        span.end(end_time=_ns(now))

    @staticmethod
    def fail(span: Any, error: BaseException, now: float) -> None:
        span.set_attribute("error.type", type(error).__name__)
        span.record_exception(error, timestamp=_ns(now))
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end(end_time=_ns(now))


def _set_cancelled(span: Any) -> None:
    span.set_attribute("error.type", "cancelled")
    span.set_status(Status(StatusCode.ERROR, "cancelled"))


def _timing_attributes(metrics: RequestMetrics, num_cached_tokens: int | None,
                       pooled: bool = False) -> dict[str, Any]:
    attributes: dict[str, Any] = {"asyncllm.request.num_preemptions": metrics.num_preemptions}
    if not pooled:
        attributes["gen_ai.usage.output_tokens"] = metrics.num_generated_tokens
        attributes["gen_ai.usage.completion_tokens"] = metrics.num_generated_tokens  # vLLM's name
    if num_cached_tokens is not None:
        attributes["asyncllm.request.num_cached_tokens"] = num_cached_tokens
    for name, value in (
        ("asyncllm.latency.queue", metrics.queue_time),
        ("asyncllm.latency.time_to_first_token", metrics.time_to_first_token),
        ("asyncllm.latency.prefill", metrics.prefill_time),
        ("asyncllm.latency.decode", None if pooled else metrics.decode_time),
        ("asyncllm.latency.inference", metrics.inference_time),
        ("asyncllm.latency.e2e", metrics.e2e_latency),
    ):
        if value is not None:
            attributes[name] = attributes[VLLM_LATENCY[name]] = value
    return attributes
