"""Prometheus series, OpenTelemetry spans, the stats log and per-request timing on a real engine.

One engine for the module, with a KV cache of 8 blocks so that a known
workload is forced into preemptions. The tracer provider is set here, in the
test only (asyncllm never installs one).
"""

from __future__ import annotations

import asyncio
import logging
import time

import prometheus_client
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from asgi_helpers import asgi_client

from asyncllm import AsyncEngine, EngineDeadError, InvalidRequestError, SamplingParams
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.processor import Submit
from asyncllm.engine.stream import RequestOptions

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXPORTER = InMemorySpanExporter()
MAX_TOKENS = 50
PROMPTS = [[3 + 7 * i + j for j in range(10 + i)] for i in range(4)]
"""Four distinct prompts (10..13 tokens): with 50 outputs each needs 4 of the 8 KV blocks."""


def _install_test_tracer_provider() -> None:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))


@pytest.fixture(scope="module")
def root_handlers() -> list:
    return list(logging.getLogger().handlers)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str, root_handlers: list):
    _install_test_tracer_provider()
    engine = AsyncEngine(tiny_llama, max_model_len=128, num_gpu_blocks_override=8, log_stats_interval=0.2)
    async with engine:
        assert logging.getLogger().handlers == root_handlers, "asyncllm must not touch the root logger"
        yield engine
    EXPORTER.shutdown()  # later test modules' spans are dropped, not kept in memory


def _value(engine: AsyncEngine, name: str, **labels: str) -> float:
    value = engine.metrics_registry.get_sample_value(name, {"model_name": engine._observer.stats.model_name, "engine": "0",
                                                           **labels})
    return 0.0 if value is None else value


def _scrape(engine: AsyncEngine) -> dict[str, float]:
    names = ["prompt_tokens_total", "generation_tokens_total", "num_preemptions_total"]
    names += [f"{h}_count" for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                                     "e2e_request_latency_seconds", "request_queue_time_seconds",
                                     "request_prefill_time_seconds", "request_decode_time_seconds",
                                     "request_prompt_tokens", "request_generation_tokens",
                                     "request_time_per_output_token_seconds")]
    scraped = {name: _value(engine, f"asyncllm:{name}") for name in names}
    for name in ("request_prompt_tokens_sum", "request_generation_tokens_sum", "request_time_per_output_token_seconds_sum"):
        scraped[name] = _value(engine, f"asyncllm:{name}")
    for reason in ("stop", "length", "abort", "timeout"):
        scraped[reason] = _value(engine, "asyncllm:request_success_total", finished_reason=reason)
    return scraped


async def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_known_workload_counters_and_histograms(engine: AsyncEngine, caplog) -> None:
    caplog.set_level(logging.INFO, logger="asyncllm")
    before = _scrape(engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
    await _wait_for(lambda: engine.stats().num_requests_running == 0)
    after = _scrape(engine)
    delta = {name: after[name] - before[name] for name in after}
    num_prompt = sum(len(p) for p in PROMPTS)
    assert delta["prompt_tokens_total"] == num_prompt == delta["request_prompt_tokens_sum"]
    assert delta["generation_tokens_total"] == 4 * MAX_TOKENS
    assert (delta["length"], delta["stop"], delta["abort"]) == (4, 0, 0)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_prompt_tokens", "request_generation_tokens"):
        assert delta[f"{name}{'' if 'tokens' in name else '_seconds'}_count"] == 4, name
    assert delta["inter_token_latency_seconds_count"] == 4 * (MAX_TOKENS - 1)
    assert delta["request_time_per_output_token_seconds_count"] == 4  # vLLM's per-request mean decode step
    tpot = sum(out.metrics.decode_time / (MAX_TOKENS - 1) for out in outs)
    assert delta["request_time_per_output_token_seconds_sum"] == pytest.approx(tpot)
    # preemptions: forced by the small KV cache, counted by the core, and seen by each request's events
    preempted = sum(out.metrics.num_preemptions for out in outs)
    assert preempted > 0 and delta["num_preemptions_total"] == preempted
    assert engine.stats().num_preemptions_total == after["num_preemptions_total"]
    for out in outs:
        m = out.metrics
        assert m.queue_time >= 0 and m.prefill_time >= 0 and m.decode_time >= 0
        assert m.arrival_time <= m.queued_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    # the stats line went through the asyncllm logger hierarchy only; it comes at the
    # next log_stats_interval tick, which may fall after a fast workload ended
    def stats_line_logged() -> bool:
        lines = [r.getMessage() for r in caplog.records if r.name == "asyncllm.engine.stats"]
        return any("Avg generation throughput" in line and "Preemptions:" in line for line in lines)

    deadline = time.monotonic() + 5.0
    while not stats_line_logged() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert stats_line_logged()
    assert logging.getLogger("asyncllm").handlers == []
    assert all(type(h).__module__.startswith("_pytest") for h in logging.getLogger().handlers)


async def test_stats_snapshot_matches_the_registry(engine: AsyncEngine) -> None:
    await engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    s = engine.stats()
    assert s.prompt_tokens_total == _value(engine, "asyncllm:prompt_tokens_total")
    assert s.generation_tokens_total == _value(engine, "asyncllm:generation_tokens_total")
    length = _value(engine, "asyncllm:request_success_total", finished_reason="length")
    assert s.request_success_total["length"] == length
    assert s.prefix_cache_queries == _value(engine, "asyncllm:prefix_cache_queries_total")
    assert s.num_gpu_blocks == 8 and s.engine_alive


def _spans_named(request_id: str) -> list:
    return [s for s in EXPORTER.get_finished_spans() if s.attributes.get("gen_ai.response.id") == request_id]


async def test_span_is_a_child_of_the_callers_span_with_gen_ai_attributes(engine: AsyncEngine) -> None:
    tracer = trace.get_tracer("test")
    params = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=5, ignore_eos=True, seed=1)
    with tracer.start_as_current_span("caller") as caller:
        out = await engine.generate(PROMPTS[1], params, request_id="traced-1")
    (span,) = _spans_named("traced-1")
    assert span.parent.span_id == caller.get_span_context().span_id
    assert span.context.trace_id == caller.get_span_context().trace_id
    a = span.attributes
    model_name = engine._observer.stats.model_name
    assert a["gen_ai.operation.name"] == "text_completion" and span.name == f"text_completion {model_name}"
    assert a["gen_ai.request.model"] == engine._observer.stats.model_name
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (5, 0.5, 0.9)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (len(PROMPTS[1]), 5)
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["asyncllm.latency.time_to_first_token"] == pytest.approx(out.metrics.time_to_first_token)
    assert a["asyncllm.latency.queue"] >= 0 and a["asyncllm.latency.decode"] >= 0
    assert a["asyncllm.request.num_preemptions"] == out.metrics.num_preemptions
    names = [e.name for e in span.events]
    assert names[:3] == ["queued", "scheduled", "first_token"] and names[-1] == "finished"
    assert span.status.status_code is StatusCode.UNSET
    assert span.start_time == int(out.metrics.arrival_time * 1e9)


async def test_span_carries_vllms_attribute_names_too(engine: AsyncEngine) -> None:
    """vLLM's ``llm_request`` span names its figures gen_ai.request.id, gen_ai.usage.prompt_tokens,
    gen_ai.latency.time_in_queue, ...: trace queries written for vLLM find them on ours, with the same values."""
    out = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True), request_id="traced-vllm")
    (span,) = _spans_named("traced-vllm")
    a, m = span.attributes, out.metrics
    assert (a["gen_ai.request.id"], a["gen_ai.request.n"]) == ("traced-vllm", 1)
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (len(PROMPTS[0]), 4)
    for name, value in (("time_in_queue", m.queue_time), ("time_to_first_token", m.time_to_first_token),
                        ("time_in_model_prefill", m.prefill_time), ("time_in_model_decode", m.decode_time),
                        ("time_in_model_inference", m.inference_time), ("e2e", m.e2e_latency)):
        assert a[f"gen_ai.latency.{name}"] == pytest.approx(value), name


async def test_a_pooling_request_generates_nothing_and_finishes_stop_as_vllms(engine: AsyncEngine) -> None:
    before = _scrape(engine)
    out = await engine.embed(PROMPTS[2], request_id="traced-embed")
    after = _scrape(engine)
    delta = {name: after[name] - before[name] for name in after}
    assert out.metrics.num_generated_tokens == 0 and delta["generation_tokens_total"] == 0
    assert (delta["stop"], delta["length"]) == (1, 0)
    assert (delta["request_generation_tokens_count"], delta["request_generation_tokens_sum"]) == (1, 0)
    assert delta["prompt_tokens_total"] == len(PROMPTS[2])
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prefill_time_seconds"):
        assert delta[f"{name}_count"] == 1, name
    for name in ("inter_token_latency_seconds", "request_decode_time_seconds"):
        assert delta[f"{name}_count"] == 0, name  # it decodes nothing
    tpot = "request_time_per_output_token_seconds"
    assert (delta[f"{tpot}_count"], delta[f"{tpot}_sum"]) == (1, 0)  # vLLM's 0 for a request without decode steps
    (span,) = _spans_named("traced-embed")
    a = span.attributes
    assert span.name == f"embeddings {engine._observer.stats.model_name}" and a["gen_ai.operation.name"] == "embeddings"
    assert a["gen_ai.response.finish_reasons"] == ("stop",) and a["gen_ai.usage.input_tokens"] == len(PROMPTS[2])
    assert not {"gen_ai.usage.output_tokens", "gen_ai.request.max_tokens", "asyncllm.latency.decode"} & set(a)


async def test_the_servers_request_span_is_a_child_of_the_callers_traceparent(engine: AsyncEngine) -> None:
    from asyncllm.integrations.openai_server import create_app

    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        reply = await client.post("/v1/completions", headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                                  json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    (span,) = [s for s in EXPORTER.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
    assert f"{span.parent.span_id:016x}" == parent_id and span.parent.is_remote
    assert span.attributes["gen_ai.operation.name"] == "text_completion"


def _instrumented(app, server_spans: list):
    """An app as OpenTelemetry's ASGI instrumentation serves it: each request in a server span of its own, under
    the request's traceparent, with the host's baggage."""
    from opentelemetry import baggage, context, propagate

    async def server(scope, receive, send) -> None:
        headers = {key.decode(): value.decode() for key, value in scope.get("headers", ())}
        token = context.attach(baggage.set_baggage("tenant", "t1", propagate.extract(headers)))
        try:
            with trace.get_tracer("asgi").start_as_current_span("POST", kind=trace.SpanKind.SERVER) as span:
                server_spans.append(span)
                await app(scope, receive, send)
        finally:
            context.detach(token)
    return server


async def test_the_servers_request_span_stays_under_an_instrumented_hosts_server_span(engine: AsyncEngine) -> None:
    from asyncllm.integrations.openai_server import create_app

    server_spans: list = []
    trace_id, parent_id = "1af7651916cd43dd8448eb211c80319c", "c7ad6b7169203331"
    async with asgi_client(_instrumented(create_app(engine, manage_engine=False), server_spans)) as client:
        for headers in ({}, {"traceparent": f"00-{trace_id}-{parent_id}-01"}):
            reply = await client.post("/v1/completions", headers=headers, json={"prompt": [5, 6], "max_tokens": 1})
            assert reply.status_code == 200, reply.text
    for server in server_spans:  # no header: not a root; a header: under it, through the server span
        (span,) = [s for s in EXPORTER.get_finished_spans() if s.parent is not None and s.name.startswith("text_")
                   and s.parent.span_id == server.get_span_context().span_id]
        assert span.context.trace_id == server.get_span_context().trace_id
    assert f"{server_spans[1].get_span_context().trace_id:032x}" == trace_id


async def test_span_parent_is_where_the_stream_was_made_not_where_it_is_iterated(engine: AsyncEngine) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("handler") as handler:  # a handler returns a StreamingResponse of the stream
        stream = engine.stream(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True), request_id="traced-lazy")
    with tracer.start_as_current_span("response-writer"):
        async for _ in stream:
            pass
    (span,) = _spans_named("traced-lazy")
    assert span.parent.span_id == handler.get_span_context().span_id


class _RaisingSpanProcessor(SpanProcessor):
    """A host's span processor with a bug, for the spans of requests ``flaky-start*`` / ``flaky-end*``."""

    def on_start(self, span, parent_context=None) -> None:
        if span.attributes.get("gen_ai.response.id", "").startswith("flaky-start"):
            raise RuntimeError("host span processor bug (on_start)")

    def on_end(self, span) -> None:
        if span.attributes.get("gen_ai.response.id", "").startswith("flaky-end"):
            raise RuntimeError("host span processor bug (on_end)")


async def test_a_raising_span_processor_costs_its_spans_never_a_request(engine: AsyncEngine, caplog) -> None:
    trace.get_tracer_provider().add_span_processor(_RaisingSpanProcessor())  # acts on flaky-* requests only
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    ids = ["flaky-start-0", "flaky-end-0", "flaky-end-1"]
    with caplog.at_level(logging.ERROR, logger="asyncllm.engine"):
        outs = await asyncio.wait_for(asyncio.gather(
            *(engine.generate(PROMPTS[0], params, request_id=rid) for rid in ids)), 20)
    assert [len(out.outputs[0].token_ids) for out in outs] == [3, 3, 3]
    logged = [r.getMessage() for r in caplog.records if "OpenTelemetry" in r.getMessage()]
    assert len(logged) == 2 and {m.split("span was ")[1].split(";")[0] for m in logged} == {"started", "ended"}
    assert engine.stats().engine_alive
    assert _spans_named("flaky-start-0") == [] and len(_spans_named("flaky-end-0")) == 1  # exported before it raised


async def test_a_processor_thread_failing_mid_message_fails_the_request_it_held(
        tiny_llama: str, monkeypatch) -> None:
    async with AsyncEngine(tiny_llama, max_model_len=64, disable_log_stats=True) as other:
        processor, real_on_output = other._processor, other._observer.on_output
        queued, late = (Submit(RequestCollector(rid, time.time()), [5, 6], SamplingParams(), RequestOptions())
                        for rid in ("queued", "late"))

        def on_output(collector, out, item, now, is_prefilling) -> None:
            real_on_output(collector, out, item, now, is_prefilling)
            if collector.request_id == "doomed" and getattr(item, "finish_reason", None) is not None:
                processor._jobs.put(queued)  # posted as the thread fails: it is never served
                raise RuntimeError("a bug on the processor thread")  # after the request was untracked

        monkeypatch.setattr(other._observer, "on_output", on_output)
        with pytest.raises(EngineDeadError, match="a bug on the processor thread"):
            await asyncio.wait_for(other.generate([5, 6, 7], SamplingParams(max_tokens=2), request_id="doomed"), 10)
        with pytest.raises(EngineDeadError, match="a bug on the processor thread"):
            await asyncio.wait_for(queued.collector.get(), 5)
        processor._thread.join(5)
        for _ in range(1100):  # past the doorbell's high-water mark: no zmq.Again once the thread is gone
            processor.abort("doomed")
        with pytest.raises(EngineDeadError, match="a bug on the processor thread"):
            processor.submit(late)  # a request racing the engine's death: a typed error, never queued


async def test_a_request_with_two_samples_has_a_span_per_sample(engine: AsyncEngine) -> None:
    """As vLLM's V1 traces each child request: one span per sample, its own tokens and finish, under the caller's."""
    before = _scrape(engine)
    with trace.get_tracer("test").start_as_current_span("caller") as caller:
        await engine.generate(PROMPTS[3], SamplingParams(n=2, max_tokens=4, ignore_eos=True), request_id="traced-n2")
    spans = sorted(_spans_named("traced-n2"), key=lambda span: span.attributes["asyncllm.request.sample_index"])
    assert [span.attributes["asyncllm.request.sample_index"] for span in spans] == [0, 1]
    for span in spans:
        a = span.attributes
        assert span.parent.span_id == caller.get_span_context().span_id
        assert (a["gen_ai.response.finish_reasons"], a["gen_ai.usage.output_tokens"]) == (("length",), 4)
        assert (a["gen_ai.request.n"], a["gen_ai.request.choice.count"], a["gen_ai.request.id"]) == (1, 2, "traced-n2")
        assert a["gen_ai.latency.e2e"] > 0 and span.status.status_code is StatusCode.UNSET
    after = _scrape(engine)
    assert after["length"] - before["length"] == 2  # one per sample, as vLLM counts child requests
    assert after["e2e_request_latency_seconds_count"] - before["e2e_request_latency_seconds_count"] == 2  # each
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 2 * len(PROMPTS[3])  # per sample too


async def test_cancelled_request_span_has_error_status(engine: AsyncEngine) -> None:
    stream = engine.stream(PROMPTS[2], SamplingParams(max_tokens=100, ignore_eos=True), request_id="traced-cancel")
    async for _ in stream:
        break
    await stream.aclose()
    await _wait_for(lambda: _spans_named("traced-cancel"))
    (span,) = _spans_named("traced-cancel")
    assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "cancelled")
    assert span.events[-1].attributes["finish_reason"] == "abort"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)


async def test_failed_request_span_records_the_error(engine: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError):
        await engine.generate(list(range(1, 200)), request_id="traced-error")  # longer than max_model_len
    (span,) = _spans_named("traced-error")
    assert span.status.status_code is StatusCode.ERROR and "InvalidRequestError" in span.status.description
    assert span.attributes["error.type"] == "InvalidRequestError"
    assert [e.name for e in span.events] == ["exception"]


async def test_two_engines_keep_separate_metrics_and_the_global_registry_stays_empty(
        engine: AsyncEngine, tiny_llama: str) -> None:
    host_registry = prometheus_client.CollectorRegistry()
    before = _scrape(engine)
    async with AsyncEngine(tiny_llama, max_model_len=64, disable_log_stats=True,
                           prometheus_registry=host_registry) as other:
        assert other.metrics_registry is host_registry
        await other.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        labels = {"model_name": tiny_llama, "engine": "0"}
        length = {**labels, "finished_reason": "length"}
        assert host_registry.get_sample_value("asyncllm:request_success_total", length) == 1
        assert host_registry.get_sample_value("asyncllm:prompt_tokens_total", labels) == 3
        assert host_registry.get_sample_value("asyncllm:generation_tokens_total", labels) == 2
    assert _scrape(engine) == before
    global_names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("asyncllm:") for name in global_names)


async def test_a_second_host_exports_only_its_own_requests(engine: AsyncEngine) -> None:
    guest = AsyncEngine.connect(engine._core.address, disable_log_stats=True)
    owner_before = _scrape(engine)
    async with guest:
        await guest.generate([9, 8, 7, 6], SamplingParams(max_tokens=3, ignore_eos=True))
        await _wait_for(lambda: guest.stats().num_gpu_blocks == 8)
        served = {"model_name": engine.config.model, "engine": "0"}  # an attached host labels with the model the core serves
        assert guest.metrics_registry.get_sample_value("asyncllm:prompt_tokens_total", served) == 4
        assert guest.metrics_registry.get_sample_value("asyncllm:num_requests_running", served) is None
        assert guest.metrics_registry.get_sample_value("asyncllm:num_preemptions_total", served) is None
        assert guest.stats().num_preemptions_total == engine.stats().num_preemptions_total  # stats() shows it anyway
    owner_labels = {"model_name": engine._observer.stats.model_name, "engine": "0"}
    # the owner still reports the engine (the core's last snapshot reaches the owner's processor thread in its time)
    await _wait_for(lambda: engine.metrics_registry.get_sample_value("asyncllm:num_requests_running", owner_labels) == 0)
    owner_after = _scrape(engine)
    assert owner_after["prompt_tokens_total"] == owner_before["prompt_tokens_total"]
