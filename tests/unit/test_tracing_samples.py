"""An n > 1 request's OpenTelemetry spans, without an engine: one per sample with that sample's own figures, as
vLLM's V1 output processor traces each finished child request (vllm/v1/engine/output_processor.py `do_tracing`)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, set_span_in_context

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.processor_requests import Submit
from asyncllm.engine.stream import RequestOptions
from asyncllm.metrics.observer import RequestObserver
from asyncllm.outputs import StreamDelta
from asyncllm.protocol import EngineCoreEvent, EngineCoreEventType, RequestOutputDelta
from asyncllm.sampling import sample_seed

QUEUED, SCHEDULED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED
PROMPT = [1, 2, 3]


class _Traced:
    """An observer whose spans go to a private provider (the process's global one is left alone), and the caller's
    span they are children of."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.observer = RequestObserver("m")
        assert self.observer._tracer is not None
        self.observer._tracer._tracer = provider.get_tracer("test")
        self.caller = provider.get_tracer("caller").start_span("caller")

    def add(self, request_id: str, params: SamplingParams) -> RequestCollector:
        collector = RequestCollector(request_id, 100.0, params.n)
        collector.prompt_token_ids = list(PROMPT)
        job = Submit(collector, PROMPT, params, RequestOptions(), trace_context=set_span_in_context(self.caller))
        self.observer.on_added(job)
        return collector

    def deliver(self, collector: RequestCollector, index: int, now: float, tokens: list[int],
                reason: str | None = None, events: list[EngineCoreEvent] | None = None, cached: int = 0) -> None:
        """One delta of sample `index`, as the processor hands it over (it keeps the request's own metrics)."""
        metrics = collector.metrics
        first = index not in self._started(collector)
        if tokens and metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.num_generated_tokens += len(tokens)
        if reason is not None:
            self._finished(collector).add(index)
            if len(self._finished(collector)) == collector.num_samples:
                metrics.finished_time = now
        core_id = collector.request_id if collector.num_samples == 1 else f"{collector.request_id}-{index}"
        out = RequestOutputDelta(core_id, tokens, reason, events=events, num_cached_tokens=cached)
        self.observer.on_output(collector, out, StreamDelta(index, "x", tokens, reason), now, first)
        self._started(collector).add(index)

    def _started(self, collector: RequestCollector) -> set[int]:
        return self.__dict__.setdefault(f"started-{collector.request_id}", set())

    def _finished(self, collector: RequestCollector) -> set[int]:
        return self.__dict__.setdefault(f"finished-{collector.request_id}", set())

    def spans(self) -> dict[int | None, object]:
        """The finished spans by sample index (None: a request's own)."""
        spans = self.exporter.get_finished_spans()
        by_index = {span.attributes.get("asyncllm.request.sample_index"): span for span in spans}
        assert len(by_index) == len(spans)
        for span in spans:
            assert span.parent.span_id == self.caller.get_span_context().span_id
        return by_index


def _queued(at: float, scheduled: float) -> list[EngineCoreEvent]:
    return [EngineCoreEvent(QUEUED, at), EngineCoreEvent(SCHEDULED, scheduled)]


def test_an_n3_request_has_one_span_per_sample_with_its_own_figures_as_vllms_child_requests() -> None:
    """n = 3, sample 2 queued behind the others: each sample's span has its own timing (from the request's arrival),
    tokens, cached tokens, finish reason and events, the request's id and max_tokens, and vLLM's child's n (1) and
    seed, as `do_tracing` traces each child request; the request's n stays as gen_ai.request.choice.count."""
    traced = _Traced()
    collector = traced.add("r", SamplingParams(n=3, max_tokens=3, seed=7, temperature=0.5))
    traced.deliver(collector, 0, 102.0, [7], events=_queued(100.5, 101.0))
    traced.deliver(collector, 1, 102.0, [7], events=_queued(100.5, 101.0), cached=2)
    traced.deliver(collector, 0, 103.0, [7])
    traced.deliver(collector, 1, 103.0, [7], "stop")
    traced.deliver(collector, 0, 104.0, [7], "length")
    traced.deliver(collector, 2, 106.0, [7], events=_queued(100.5, 105.0), cached=2)
    traced.deliver(collector, 2, 107.0, [7])
    traced.deliver(collector, 2, 108.0, [7], "length")
    spans = traced.spans()
    assert sorted(spans) == [0, 1, 2]
    figures = {index: {name: span.attributes[f"gen_ai.{name}"] for name in (
        "latency.time_to_first_token", "latency.time_in_queue", "latency.time_in_model_prefill",
        "latency.time_in_model_decode", "latency.time_in_model_inference", "latency.e2e",
        "usage.completion_tokens", "response.finish_reasons")} for index, span in spans.items()}
    assert figures == {
        0: {"latency.time_to_first_token": 2.0, "latency.time_in_queue": 0.5, "latency.time_in_model_prefill": 1.0,
            "latency.time_in_model_decode": 2.0, "latency.time_in_model_inference": 3.0, "latency.e2e": 4.0,
            "usage.completion_tokens": 3, "response.finish_reasons": ("length",)},
        1: {"latency.time_to_first_token": 2.0, "latency.time_in_queue": 0.5, "latency.time_in_model_prefill": 1.0,
            "latency.time_in_model_decode": 1.0, "latency.time_in_model_inference": 2.0, "latency.e2e": 3.0,
            "usage.completion_tokens": 2, "response.finish_reasons": ("stop",)},
        2: {"latency.time_to_first_token": 6.0, "latency.time_in_queue": 4.5, "latency.time_in_model_prefill": 1.0,
            "latency.time_in_model_decode": 2.0, "latency.time_in_model_inference": 3.0, "latency.e2e": 8.0,
            "usage.completion_tokens": 3, "response.finish_reasons": ("length",)},
    }
    for index, span in spans.items():
        a = span.attributes
        assert (a["gen_ai.request.id"], a["gen_ai.response.id"], a["gen_ai.usage.prompt_tokens"]) == ("r", "r", 3)
        assert (a["gen_ai.request.n"], a["gen_ai.request.choice.count"], a["gen_ai.request.max_tokens"]) == (1, 3, 3)
        assert (a["gen_ai.request.seed"], a["gen_ai.request.temperature"]) == (sample_seed(7, index), 0.5)
        assert a["asyncllm.request.num_cached_tokens"] == (0 if index == 0 else 2)
        assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "finished"]
        assert span.status.status_code is StatusCode.UNSET
        assert span.start_time == 100 * 10**9
    assert (spans[0].end_time, spans[1].end_time, spans[2].end_time) == (104 * 10**9, 103 * 10**9, 108 * 10**9)
    assert spans[2].events[2].timestamp == 106 * 10**9  # its own first token, not the request's
    assert traced.observer._traced == {} and traced.observer._samples == {}


def test_an_n1_request_keeps_its_one_span() -> None:
    traced = _Traced()
    collector = traced.add("one", SamplingParams(max_tokens=2))
    traced.deliver(collector, 0, 102.0, [7], events=_queued(100.5, 101.0), cached=2)
    traced.deliver(collector, 0, 103.0, [7], "length")
    (span,) = traced.spans().values()
    a = span.attributes
    assert "asyncllm.request.sample_index" not in a and "gen_ai.request.choice.count" not in a
    assert (a["gen_ai.request.n"], a["gen_ai.response.finish_reasons"], a["gen_ai.usage.output_tokens"]) == (
        1, ("length",), 2)
    assert (a["gen_ai.latency.e2e"], a["gen_ai.latency.time_to_first_token"]) == (3.0, 2.0)
    assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "finished"]


def test_an_aborted_n_request_ends_each_unfinished_samples_span_cancelled() -> None:
    """The caller left after sample 0 finished: its span stays a finished one; samples 1 (a token out) and 2 (none)
    end cancelled, once each, however many samples the processor reports aborted."""
    traced = _Traced()
    collector = traced.add("a", SamplingParams(n=3, max_tokens=5))
    traced.deliver(collector, 0, 102.0, [7], events=_queued(100.5, 101.0))
    traced.deliver(collector, 1, 102.0, [7], events=_queued(100.5, 101.0))
    traced.deliver(collector, 0, 103.0, [7], "stop")
    traced.observer.on_aborted(collector, 104.0)  # once per unfinished sample
    traced.observer.on_aborted(collector, 104.0)
    spans = traced.spans()
    assert sorted(spans) == [0, 1, 2]
    assert spans[0].status.status_code is StatusCode.UNSET
    assert spans[0].attributes["gen_ai.response.finish_reasons"] == ("stop",)
    for index in (1, 2):
        span = spans[index]
        assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "cancelled")
        assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
        assert span.events[-1].attributes["finish_reason"] == "abort" and span.end_time == 104 * 10**9
    assert spans[1].attributes["gen_ai.latency.time_to_first_token"] == 2.0  # its own figures so far
    assert spans[1].attributes["gen_ai.usage.completion_tokens"] == 1
    assert "gen_ai.latency.time_to_first_token" not in spans[2].attributes  # it had no token
    assert traced.observer._traced == {}


@pytest.mark.parametrize("how", ["error_delta", "rejected", "unsent"])
def test_a_failed_n_request_ends_each_samples_span_failed(how: str) -> None:
    traced = _Traced()
    params = SamplingParams(n=2, max_tokens=5)
    error = InvalidRequestError("prompt", "too long")
    if how != "error_delta":  # refused before it was sent (a duplicate id, a bad prompt), or its adapter's check
        collector = RequestCollector("f", 100.0, 2)
        job = Submit(collector, PROMPT, params, RequestOptions(), trace_context=set_span_in_context(traced.caller))
        if how == "rejected":
            traced.observer.on_rejected(job, error, 101.0)
        else:
            traced.observer.on_ended_unsent(job, error, 101.0)
    else:  # sample 1 refused by the core: the processor fails the request, its other samples untracked
        collector = traced.add("f", params)
        traced.deliver(collector, 0, 102.0, [7], events=_queued(100.5, 101.0))
        traced.observer.on_output(collector, RequestOutputDelta("f-1", [], "abort", error="x"), error, 103.0, True)
        traced.observer.on_error(collector, error, 103.0)  # safe once per sample
    spans = traced.spans()
    assert sorted(spans) == [0, 1]
    for span in spans.values():
        assert span.status.status_code is StatusCode.ERROR and "InvalidRequestError" in span.status.description
        assert span.attributes["error.type"] == "InvalidRequestError" and span.events[-1].name == "exception"
    assert traced.observer._traced == {}


@pytest.mark.parametrize("n", [1, 2])
def test_an_unset_max_tokens_is_on_the_span_as_vllm_sets_it(n: int) -> None:
    """A request without max_tokens (an OpenAI chat request that names none) runs to max_model_len: its span carries
    gen_ai.request.max_tokens = max_model_len - the prompt's tokens, what vLLM's server puts in its SamplingParams
    (and so on its llm_request span) and what request_params_max_tokens observes; a request refused before its
    prompt was read has none."""
    traced = _Traced()
    traced.observer.max_model_len = 128
    collector = traced.add("u", SamplingParams(n=n, max_tokens=None))
    for index in range(n):
        traced.deliver(collector, index, 102.0, [7], "stop")
    for span in traced.spans().values():
        assert span.attributes["gen_ai.request.max_tokens"] == 128 - len(PROMPT)
    histogram = traced.observer.stats.request_params_max_tokens
    assert (histogram.count, histogram.sum) == (n, n * (128 - len(PROMPT)))
    refused = _Traced()
    refused.observer.max_model_len = 128
    job = Submit(RequestCollector("x", 100.0), PROMPT, SamplingParams(max_tokens=None), RequestOptions(),
                 trace_context=set_span_in_context(refused.caller))
    refused.observer.on_rejected(job, InvalidRequestError("prompt", "bad"), 101.0)
    (span,) = refused.spans().values()
    assert "gen_ai.request.max_tokens" not in span.attributes
