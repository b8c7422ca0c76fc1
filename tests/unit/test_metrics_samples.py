"""An n > 1 request's samples in the request timing and the inter-token latency, without an engine."""

from __future__ import annotations

from asyncllm.engine.collector import RequestCollector
from asyncllm.metrics.observer import RequestObserver
from asyncllm.metrics.request_timing import apply_events
from asyncllm.outputs import RequestMetrics, StreamDelta
from asyncllm.protocol import EngineCoreEvent, EngineCoreEventType, RequestOutputDelta

QUEUED, SCHEDULED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED


def test_the_first_scheduled_time_is_the_earliest_samples_whatever_the_order_of_their_events() -> None:
    metrics = RequestMetrics(arrival_time=10.0)  # sample 1's events folded before sample 0's (one core message)
    apply_events(metrics, [EngineCoreEvent(QUEUED, 10.5), EngineCoreEvent(SCHEDULED, 12.0)])
    apply_events(metrics, [EngineCoreEvent(QUEUED, 10.5), EngineCoreEvent(SCHEDULED, 11.0)])
    assert (metrics.first_scheduled_time, metrics.queue_time) == (11.0, 0.5)


def test_a_sample_queued_behind_the_others_adds_no_inter_token_latency() -> None:
    """n = 2: the wait for a sample's first token (queued behind sample 0, its prefill) is no sample's inter-token
    latency; a step carrying one sample's first token and another's next token observes the latter's, whatever the
    order of their deltas."""
    observer = RequestObserver("m")

    def deliver(collector: RequestCollector, index: int, now: float, reason: str | None, first: bool) -> None:
        metrics = collector.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.num_generated_tokens += 1
        metrics.finished_time = now if reason is not None and index == 1 else None
        observer.on_output(collector, RequestOutputDelta(f"{collector.request_id}-{index}", [7], reason),
                           StreamDelta(index, "x", [7], reason), now, first)

    queued, mixed = RequestCollector("q", 100.0, n=2), RequestCollector("r", 100.0, n=2)
    for collector, deltas in ((queued, [(0, 101.0, None, True), (0, 102.0, "length", False),
                                        (1, 105.0, None, True), (1, 106.0, "length", False)]),
                              (mixed, [(0, 101.0, None, True), (1, 102.0, None, True), (0, 102.0, None, False),
                                       (0, 103.0, "length", False), (1, 103.0, "length", False)])):
        for index, now, reason, first in deltas:
            deliver(collector, index, now, reason, first)
    itl = observer.stats.inter_token_latency
    assert (itl.count, itl.sum) == (4, 4.0)  # q: 101->102, 105->106; r: 101->102, 102->103
    assert observer._steps == {}
