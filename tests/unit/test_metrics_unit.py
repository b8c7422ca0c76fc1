"""Host-side stats, the Prometheus collector, request timing and the stats line, without an engine."""

from __future__ import annotations

import gc
import subprocess
import sys

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.stats_log import StatsLogger
from asyncllm.metrics import host_stats, prometheus
from asyncllm.metrics.host_stats import Histogram, HostStats
from asyncllm.metrics.observer import RequestObserver
from asyncllm.metrics.prometheus import attach
from asyncllm.metrics.request_timing import apply_events
from asyncllm.outputs import EngineStats, RequestMetrics, StreamDelta
from asyncllm.protocol import EngineCoreEvent, EngineCoreEventType, RequestOutputDelta, SchedulerStats

QUEUED, SCHEDULED, PREEMPTED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


def test_histogram_buckets_are_le_inclusive() -> None:
    h = Histogram([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(value)
    assert h.counts == [2, 2, 1] and h.count == 5 and h.sum == pytest.approx(4.65)


def test_events_fill_request_metrics() -> None:
    m = RequestMetrics(arrival_time=10.0)
    apply_events(m, [EngineCoreEvent(QUEUED, 10.5), EngineCoreEvent(SCHEDULED, 11.0)])
    apply_events(m, [EngineCoreEvent(PREEMPTED, 12.0), EngineCoreEvent(SCHEDULED, 13.0)])
    m.first_token_time, m.last_token_time, m.finished_time = 11.25, 14.0, 14.0
    assert (m.queued_time, m.first_scheduled_time, m.num_preemptions) == (10.5, 11.0, 1)
    assert (m.queue_time, m.prefill_time, m.decode_time, m.inference_time) == (0.5, 0.25, 2.75, 3.0)
    assert (m.time_to_first_token, m.e2e_latency) == (1.25, 4.0)
    samples = RequestMetrics(arrival_time=10.0)  # n > 1: sample 1 queued after sample 0 was scheduled
    apply_events(samples, [EngineCoreEvent(QUEUED, 10.5), EngineCoreEvent(SCHEDULED, 11.0)])
    apply_events(samples, [EngineCoreEvent(QUEUED, 11.5), EngineCoreEvent(SCHEDULED, 12.0)])
    assert (samples.queued_time, samples.first_scheduled_time, samples.queue_time) == (10.5, 11.0, 0.5)


def _collector(request_id: str, prompt_len: int, arrival: float, n: int = 1) -> RequestCollector:
    collector = RequestCollector(request_id, arrival, n=n)
    collector.prompt_token_ids = [1] * prompt_len
    return collector


def _feed(observer: RequestObserver, collector: RequestCollector, times: list[float], reason: str) -> None:
    """Deliver one token per time, the way the processor does (it sets first_token/finished times first)."""
    metrics = collector.metrics
    for i, now in enumerate(times):
        last = i == len(times) - 1
        events = None
        if i == 0:
            arrival = metrics.arrival_time
            events = [EngineCoreEvent(QUEUED, arrival), EngineCoreEvent(SCHEDULED, arrival + 0.5)]
        out = RequestOutputDelta(collector.request_id, [7], reason if last else None, events=events)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.num_generated_tokens += 1
        if last:
            metrics.finished_time = now
        observer.on_output(collector, out, StreamDelta(0, "x", [7], reason if last else None), now, i == 0)


def test_observer_counts_tokens_requests_and_histograms() -> None:
    observer = RequestObserver("m")
    a, b = _collector("a", 5, 100.0), _collector("b", 3, 100.0)
    _feed(observer, a, [101.0, 101.5, 102.0], "length")
    _feed(observer, b, [101.0, 103.0], "stop")
    observer.on_aborted(_collector("c", 4, 100.0), 104.0)
    observer.on_scheduler_stats(SchedulerStats(num_requests_running=2, num_gpu_blocks=10, num_used_blocks=4,
                                               num_preemptions_total=3, prefix_cache_queries=8, prefix_cache_hits=4),
                                reporter=True)
    assert observer.stats.reports_engine
    s = observer.stats
    assert (s.prompt_tokens_total, s.generation_tokens_total) == (8, 5)
    assert s.request_success == {"stop": 1, "length": 1, "abort": 1, "timeout": 0}
    assert (s.time_to_first_token.count, s.time_to_first_token.sum) == (2, 2.0)
    assert (s.inter_token_latency.count, s.inter_token_latency.sum) == (3, 3.0)
    assert (s.e2e_request_latency.count, s.e2e_request_latency.sum) == (2, 5.0)  # the aborted one is not observed
    assert (s.request_queue_time.sum, s.request_prefill_time.sum, s.request_decode_time.sum) == (1.0, 1.0, 3.0)
    assert (s.request_prompt_tokens.sum, s.request_generation_tokens.sum) == (8, 5)
    assert (s.request_time_per_output_token.count, s.request_time_per_output_token.sum) == (2, 2.5)  # 1/2, 2/1
    snap = observer.stats.snapshot()
    assert (snap.num_requests_running, snap.kv_cache_usage, snap.num_preemptions_total) == (2, 0.4, 3)
    assert snap.request_success_total == {"stop": 1, "length": 1, "abort": 1, "timeout": 0} and snap.prefix_cache_hit_rate == 0.5


def test_samples_of_one_request_count_tokens_reasons_and_latencies_each_as_vllms_child_requests() -> None:
    observer = RequestObserver("m")
    collector = _collector("r", 4, 100.0, n=2)
    metrics = collector.metrics
    for now, reasons in ((101.0, (None, None)), (102.0, ("stop", None)), (103.0, (None, "length"))):
        for index, reason in enumerate(reasons):
            if reason is None and now == 103.0:
                continue  # sample 0 already finished
            metrics.first_token_time = metrics.first_token_time or now
            metrics.num_generated_tokens += 1
            if reason == "length":  # the processor stamps the request's end at its last sample
                metrics.finished_time = now
            observer.on_output(collector, RequestOutputDelta(f"r-{index}", [7], reason),
                               StreamDelta(index, "x", [7], reason), now, now == 101.0)
    s = observer.stats
    assert (s.prompt_tokens_total, s.generation_tokens_total) == (8, 5)  # the prompt once per sample, as vLLM's
    assert (s.request_success["stop"], s.request_success["length"]) == (1, 1)
    assert (s.inter_token_latency.count, s.inter_token_latency.sum) == (3, 3.0)  # each sample's own: 2 + 1
    assert (s.e2e_request_latency.count, s.e2e_request_latency.sum) == (2, 5.0)  # 102 and 103 from 100
    assert (s.request_generation_tokens.count, s.request_generation_tokens.sum) == (2, 5)  # 2 and 3


def test_a_pooling_requests_delta_counts_its_prompt_and_no_generated_token() -> None:
    observer, collector = RequestObserver("m"), _collector("e", 6, 100.0)
    collector.metrics.first_token_time = collector.metrics.finished_time = 101.0
    observer.on_output(collector, RequestOutputDelta("e", [7], "length", embedding=b"\0" * 8),
                       StreamDelta(0, "", [], "length"), 101.0, True)
    s = observer.stats
    assert (s.prompt_tokens_total, s.generation_tokens_total, s.request_success["stop"]) == (6, 0, 1)
    assert (s.time_to_first_token.count, s.inter_token_latency.count) == (1, 0)


def test_one_token_requests_have_a_time_per_output_token_of_zero_as_vllms() -> None:
    observer = RequestObserver("m")  # vLLM's mean_time_per_output_token: 0 without a token after the first
    _feed(observer, _collector("a", 2, 100.0), [101.0], "length")
    tpot = observer.stats.request_time_per_output_token
    assert (tpot.count, tpot.sum) == (1, 0.0) and observer.stats.request_decode_time.count == 1


def test_trace_headers_are_not_read_until_the_host_sets_a_tracer_provider(monkeypatch) -> None:
    from opentelemetry import propagate, trace

    from asyncllm.metrics import tracing

    def extract(headers):
        raise AssertionError("read without a tracer provider")

    monkeypatch.setattr(propagate, "extract", extract)
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)  # none set
    with tracing.remote_parent({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}):
        pass


def test_trace_headers_keep_the_hosts_baggage_and_without_a_trace_header_its_span(monkeypatch) -> None:
    from opentelemetry import baggage, context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext

    from asyncllm.metrics import tracing

    monkeypatch.setattr(trace, "get_tracer_provider", trace.NoOpTracerProvider)  # the host set one
    host_span = NonRecordingSpan(SpanContext(0x1F, 0x2F, is_remote=False))
    token = context.attach(trace.set_span_in_context(host_span, baggage.set_baggage("tenant", "t1")))
    try:
        with tracing.remote_parent({}):
            assert trace.get_current_span() is host_span and baggage.get_baggage("tenant") == "t1"
        with tracing.remote_parent({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}):
            parent = trace.get_current_span().get_span_context()
            assert (parent.span_id, parent.is_remote, baggage.get_baggage("tenant")) == (0xB7AD6B7169203331, True, "t1")
    finally:
        context.detach(token)


def test_private_registry_exports_the_series_and_never_the_global_one() -> None:
    observer = RequestObserver("my-model")
    observer.stats.reports_engine = True
    _feed(observer, _collector("a", 5, 100.0), [100.25, 100.5], "stop")
    reg, labels = observer.registry, {"model_name": "my-model", "engine": "0"}
    assert reg.get_sample_value("asyncllm:prompt_tokens_total", labels) == 5
    assert reg.get_sample_value("asyncllm:generation_tokens_total", labels) == 2
    assert reg.get_sample_value("asyncllm:request_success_total", {**labels, "finished_reason": "stop"}) == 1
    assert reg.get_sample_value("asyncllm:request_success_total", {**labels, "finished_reason": "abort"}) == 0
    assert reg.get_sample_value("asyncllm:time_to_first_token_seconds_bucket", {**labels, "le": "0.2"}) is None
    assert reg.get_sample_value("asyncllm:time_to_first_token_seconds_bucket", {**labels, "le": "0.1"}) == 0
    assert reg.get_sample_value("asyncllm:time_to_first_token_seconds_bucket", {**labels, "le": "0.25"}) == 1
    assert reg.get_sample_value("asyncllm:inter_token_latency_seconds_count", labels) == 1
    assert reg.get_sample_value("asyncllm:num_requests_running", labels) == 0
    names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("asyncllm:") for name in names)


def test_engines_sharing_a_registry_sum_per_model_and_engine_series_come_from_the_owner() -> None:
    reg = CollectorRegistry()
    owner, guest, other = HostStats("m"), HostStats("m"), HostStats("n")
    owner.reports_engine, other.reports_engine = True, True
    for stats, running in ((owner, 2), (guest, 5), (other, 1)):
        attach(stats, reg)
        stats.scheduler = SchedulerStats(num_requests_running=running, num_gpu_blocks=10, num_used_blocks=running)
        stats.prompt_tokens_total = 10 * running
    # the guest does not export engine-wide series; each host exports its own requests
    assert reg.get_sample_value("asyncllm:num_requests_running", {"model_name": "m", "engine": "0"}) == 2
    assert reg.get_sample_value("asyncllm:kv_cache_usage_perc", {"model_name": "m", "engine": "0"}) == 0.2
    assert reg.get_sample_value("asyncllm:prompt_tokens_total", {"model_name": "m", "engine": "0"}) == 70  # each host its own requests
    assert reg.get_sample_value("asyncllm:num_requests_running", {"model_name": "n", "engine": "0"}) == 1
    twin = HostStats("n")
    twin.reports_engine = True
    twin.scheduler = SchedulerStats(num_requests_running=3, num_gpu_blocks=30, num_used_blocks=3)
    attach(twin, reg)
    assert reg.get_sample_value("asyncllm:num_requests_running", {"model_name": "n", "engine": "0"}) == 4
    assert reg.get_sample_value("asyncllm:kv_cache_usage_perc", {"model_name": "n", "engine": "0"}) == 0.1  # 4 of 40 blocks
    del twin
    gc.collect()
    assert reg.get_sample_value("asyncllm:num_requests_running", {"model_name": "n", "engine": "0"}) == 1  # a dropped engine drops out


def test_mark_closed_zeroes_the_gauges_and_stops_reporting_the_engine() -> None:
    stats = HostStats("m")
    reg = attach(stats, None)
    stats.reports_engine = True
    stats.scheduler = SchedulerStats(num_requests_running=2, num_gpu_blocks=10, num_used_blocks=5,
                                     num_preemptions_total=4)
    assert reg.get_sample_value("asyncllm:num_preemptions_total", {"model_name": "m", "engine": "0"}) == 4
    stats.scheduler = SchedulerStats(num_requests_running=2, num_gpu_blocks=10, num_used_blocks=5, num_preemptions_total=4,
                                     mm_encoder_cache_queries=5, mm_encoder_cache_hits=2, num_swapped_total=3,
                                     weights_version=2)
    stats.mm_cache_queries, stats.mm_cache_hits = 7, 3
    assert reg.get_sample_value("asyncllm:mm_encoder_cache_queries_total", {"model_name": "m", "engine": "0"}) == 5
    assert reg.get_sample_value("asyncllm:mm_encoder_cache_hits_total", {"model_name": "m", "engine": "0"}) == 2
    assert reg.get_sample_value("asyncllm:mm_cache_queries_total", {"model_name": "m", "engine": "0"}) == 7
    assert reg.get_sample_value("asyncllm:mm_cache_hits_total", {"model_name": "m", "engine": "0"}) == 3
    stats.mark_closed()
    snap = stats.snapshot(engine_alive=False)
    assert (snap.num_requests_running, snap.num_used_blocks, snap.num_preemptions_total) == (0, 0, 4)
    assert (snap.num_swapped_total, snap.weights_version) == (3, 2)  # counters survive the close
    assert not snap.engine_alive
    assert reg.get_sample_value("asyncllm:num_preemptions_total", {"model_name": "m", "engine": "0"}) is None


def test_stats_line_format_and_quiet_when_idle() -> None:
    prev = EngineStats(num_gpu_blocks=100, prompt_tokens_total=100, generation_tokens_total=50,
                       prefix_cache_queries=40, prefix_cache_hits=10)
    cur = EngineStats(num_requests_running=3, num_requests_waiting=1, num_gpu_blocks=100, num_used_blocks=25,
                      kv_cache_usage=0.25, num_preemptions_total=2, prompt_tokens_total=300,
                      generation_tokens_total=150, prefix_cache_queries=80, prefix_cache_hits=30)
    assert StatsLogger.format_line(prev, cur, 10.0) == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, Preemptions: 2, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%"
    )
    assert StatsLogger.format_line(EngineStats(), EngineStats(num_gpu_blocks=100), 10.0) is None


def test_stats_line_after_a_shared_cores_restart_counts_the_new_cores_figures() -> None:
    """A host attached to a shared core that restarted (max_core_restarts) sees the engine-wide counters start over
    from 0: the line's interval figures are the new core's counts (a counter reset, as Prometheus' rate() reads
    one), never a negative or made-up hit rate or acceptance."""
    prev = EngineStats(num_gpu_blocks=100, prompt_tokens_total=100, generation_tokens_total=50,
                       prefix_cache_queries=1000, prefix_cache_hits=0, num_preemptions_total=7,
                       spec_decode_num_drafts=100, spec_decode_num_draft_tokens=400,
                       spec_decode_num_accepted_tokens=300, spec_decode_accepted_per_pos=[90, 80, 70, 60])
    cur = EngineStats(num_requests_running=1, num_gpu_blocks=100, kv_cache_usage=0.1, num_used_blocks=10,
                      prompt_tokens_total=200, generation_tokens_total=100, prefix_cache_queries=100,
                      prefix_cache_hits=50, spec_decode_num_drafts=10, spec_decode_num_draft_tokens=40,
                      spec_decode_num_accepted_tokens=20, spec_decode_accepted_per_pos=[8, 6, 4, 2])
    assert StatsLogger.format_line(prev, cur, 10.0) == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 1 reqs, "
        "Waiting: 0 reqs, Preemptions: 0, KV cache usage: 10.0%, Prefix cache hit rate: 50.0%, "
        "SpecDecoding: Mean acceptance length: 3.00, Accepted: 20 tokens, Drafted: 40 tokens, "
        "Draft acceptance rate: 50.0%, Per-position acceptance rate: 0.800, 0.600, 0.400, 0.200"
    )


def test_without_opentelemetry_tracing_is_a_none_check() -> None:
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"  # makes `import opentelemetry...` raise ImportError
        "from asyncllm.metrics.observer import RequestObserver\n"
        "from asyncllm.metrics.tracing import capture_context, tracing_available\n"
        "assert not tracing_available() and capture_context() is None\n"
        "assert RequestObserver('m')._tracer is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_grafana_dashboard_uses_only_exported_series() -> None:
    import pathlib
    import re

    dashboard = pathlib.Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json"
    used = set(re.findall(r"asyncllm:[a-z0-9_]+", dashboard.read_text()))
    observer = RequestObserver("m")
    observer.stats.reports_engine = True
    registry = observer.registry
    exported = {sample.name for family in registry.collect() for sample in family.samples}
    exported |= {family.name + suffix for family in registry.collect() for suffix in ("", "_total")}
    assert used and used <= exported, used - exported


def _counters(reg: CollectorRegistry) -> tuple:
    labels = {"model_name": "m", "engine": "0"}
    return (reg.get_sample_value("asyncllm:prefix_cache_queries_total", labels),
            reg.get_sample_value("asyncllm:prompt_tokens_total", labels),
            reg.get_sample_value("asyncllm:request_success_total", {**labels, "finished_reason": "length"}),
            reg.get_sample_value("asyncllm:time_to_first_token_seconds_count", labels))


def test_an_engine_closed_for_good_leaves_its_counters_in_the_shared_registry() -> None:
    reg = CollectorRegistry()
    old, new = RequestObserver("m", reg), RequestObserver("m", reg)  # e.g. a model reload: two engines, one registry
    for observer, n in ((old, 40), (new, 10)):
        observer.stats.owns_core = True
        observer.on_scheduler_stats(SchedulerStats(num_requests_running=1, prefix_cache_queries=n), reporter=True)
        observer.stats.prompt_tokens_total = n
        observer.stats.count_finished("length")
        observer.stats.time_to_first_token.observe(0.1)
    assert _counters(reg) == (50, 50, 2, 2)
    old.on_closed()
    assert _counters(reg) == (50, 50, 2, 2)  # a counter that went down would read as a reset
    assert reg.get_sample_value("asyncllm:num_requests_running", {"model_name": "m", "engine": "0"}) == 1  # gauges leave
    del old
    gc.collect()
    assert _counters(reg) == (50, 50, 2, 2)


def test_a_restarted_core_counts_on_from_its_predecessors_final_counters() -> None:
    stats = HostStats("m")
    reg = attach(stats, None)
    stats.owns_core, stats.reports_engine = True, True
    stats.scheduler = SchedulerStats(prefix_cache_queries=30, spec_decode_accepted_per_pos=[3, 1])
    stats.mark_closed()  # the core died; the supervisor starts a new one, which counts from 0
    stats.mark_closed()  # and the engine closes: nothing is counted twice
    stats.scheduler = SchedulerStats(prefix_cache_queries=4, spec_decode_accepted_per_pos=[2])
    stats.reports_engine = True
    assert reg.get_sample_value("asyncllm:prefix_cache_queries_total", {"model_name": "m", "engine": "0"}) == 34
    per_pos = {"model_name": "m", "engine": "0", "position": "1"}
    assert reg.get_sample_value("asyncllm:spec_decode_num_accepted_tokens_per_pos_total", per_pos) == 1
    snapshot = stats.snapshot()  # engine.stats() reads the same numbers: they never go down
    assert (snapshot.prefix_cache_queries, snapshot.spec_decode_accepted_per_pos) == (34, [5, 1])
    stats.mark_closed()
    assert stats.snapshot().prefix_cache_queries == 34  # closed: its last counters, not twice


def _three_engines() -> tuple[CollectorRegistry, list[RequestObserver]]:
    reg = CollectorRegistry()
    observers = [RequestObserver("m", reg) for _ in range(3)]
    for observer, n in zip(observers, (100, 40, 10), strict=True):
        observer.stats.owns_core = True
        observer.on_scheduler_stats(SchedulerStats(prefix_cache_queries=n), reporter=True)
        observer.stats.prompt_tokens_total = n
    observers[0].on_closed()  # an engine closed for good earlier: the retired totals exist
    return reg, observers


def _prompt_and_queries(reg: CollectorRegistry) -> tuple:
    return _counters(reg)[:2]


def test_a_scrape_overlapping_an_engines_close_counts_it_once() -> None:
    reg, (_, closing, _) = _three_engines()
    collector, lock = prometheus._collectors[reg], prometheus._collectors[reg]._lock

    class RetireAfterTheCopy:  # the loop closes `closing` between the scrape's copy of the sources and its reads
        def __enter__(self):
            return lock.__enter__()

        def __exit__(self, *exc):
            lock.__exit__(*exc)
            collector._lock = lock
            closing.on_closed()

    collector._lock = RetireAfterTheCopy()
    assert _prompt_and_queries(reg) == (150, 150)
    assert collector._lock is lock and _prompt_and_queries(reg) == (150, 150)


def test_a_scrape_in_the_middle_of_mark_closed_sees_the_counters_whole(monkeypatch) -> None:
    reg, (_, _, closing) = _three_engines()
    seen, summed = [], host_stats.summed_snapshots

    def scraped_midway(snapshots):
        seen.append(_prompt_and_queries(reg))
        return summed(snapshots)

    monkeypatch.setattr(host_stats, "summed_snapshots", scraped_midway)
    closing.stats.mark_closed()
    assert seen == [(150, 150)] and _prompt_and_queries(reg) == (150, 150)


def test_two_engines_lora_settings_are_not_summed_and_their_adapters_are_united() -> None:
    a = SchedulerStats(max_lora=2, running_lora_adapters=["ad1"], weights_version=3, prefix_cache_queries=5)
    b = SchedulerStats(max_lora=2, running_lora_adapters=["ad2", "ad1"], weights_version=3, prefix_cache_queries=7)
    summed = host_stats.summed_snapshots([a, b])
    assert (summed.max_lora, summed.running_lora_adapters, summed.weights_version) == (2, ["ad1", "ad2"], 3)
    assert summed.prefix_cache_queries == 12  # amounts still add up


def test_a_live_host_that_does_not_report_the_engine_still_counts_its_live_core() -> None:
    """A restarted shared core may pick another host as its reporter: the owner's stats() counts on all the same."""
    stats = HostStats("m")
    stats.owns_core, stats.reports_engine = True, True
    stats.scheduler = SchedulerStats(prefix_cache_queries=30)
    stats.mark_closed()  # the core died
    stats.take_snapshot(SchedulerStats(prefix_cache_queries=4), False)  # the new core's, another host reporting
    assert stats.snapshot().prefix_cache_queries == 34


def test_cache_config_info_is_vllms_info_gauge_of_the_reported_cores_settings() -> None:
    from asyncllm.config import CacheConfig
    reg = CollectorRegistry()
    owner, guest = RequestObserver("m", reg), RequestObserver("m", reg)  # two hosts of one core: reported once
    for observer, reporter in ((owner, True), (guest, False)):
        observer.stats.set_cache_config(CacheConfig(block_size=32, enable_prefix_caching=False))
        observer.on_scheduler_stats(SchedulerStats(num_gpu_blocks=10), reporter=reporter)
    [family] = [f for f in reg.collect() if f.name == "asyncllm:cache_config_info"]
    [sample] = family.samples
    assert sample.value == 1 and sample.labels["engine"] == "0" and sample.labels["model_name"] == "m"
    assert {k: sample.labels[k] for k in ("block_size", "enable_prefix_caching", "num_gpu_blocks", "cache_dtype",
                                          "num_gpu_blocks_override", "gpu_memory_utilization")} == {
        "block_size": "32", "enable_prefix_caching": "False", "num_gpu_blocks": "10", "cache_dtype": "auto",
        "num_gpu_blocks_override": "None", "gpu_memory_utilization": "0.9"}
    owner.stats.request_params_n.observe(2)
    owner.on_closed()  # its gauges leave; its histograms stay
    assert not [f for f in reg.collect() if f.name == "asyncllm:cache_config_info"][0].samples
    assert reg.get_sample_value("asyncllm:request_params_n_bucket", {"model_name": "m", "engine": "0", "le": "2.0"}) == 1
