"""An n > 1 request's samples in the request timing and histograms, without an engine: each observed on its own, as
vLLM's V1 observes each child request (vllm/v1/metrics/stats.py, `IterationStats`)."""

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
    latency; each sample's later tokens observe its own, from its own token before, as vLLM's child requests (a step
    advancing two samples observes two), whatever the order of their deltas."""
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
    assert (itl.count, itl.sum) == (5, 5.0)  # q: 0 101->102, 1 105->106; r: 0 101->102->103, 1 102->103
    assert observer._samples == {}


def test_a_samples_decode_time_and_time_per_output_token_are_its_own_as_vllms_child_requests() -> None:
    """n = 2, sample 1 queued behind sample 0 (its first token at 110): vLLM observes each child request's decode time
    (its first token to its last) and mean time per output token; the wait is in neither."""
    observer = RequestObserver("m")
    collector = RequestCollector("q", 100.0, n=2)
    metrics = collector.metrics
    for index, now, reason, first in ((0, 101.0, None, True), (0, 102.0, None, False), (0, 103.0, "length", False),
                                      (1, 110.0, None, True), (1, 111.0, "length", False)):
        metrics.first_token_time = metrics.first_token_time or now
        metrics.num_generated_tokens += 1
        metrics.finished_time = now if index == 1 and reason is not None else None
        delta = StreamDelta(index, "x", [7], reason)
        observer.on_output(collector, RequestOutputDelta(f"q-{index}", [7], reason), delta, now, first)
    stats = observer.stats
    assert (stats.request_decode_time.count, stats.request_decode_time.sum) == (2, 3.0)  # 101->103, 110->111
    assert (stats.request_time_per_output_token.count, stats.request_time_per_output_token.sum) == (2, 2.0)  # 2/2, 1/1
    assert (stats.e2e_request_latency.count, stats.e2e_request_latency.sum) == (2, 14.0)  # 103 and 111 from 100
    assert observer._samples == {}


def test_an_aborted_sample_has_no_decode_time_and_its_finished_sibling_keeps_its_own() -> None:
    observer = RequestObserver("m")
    collector = RequestCollector("a", 100.0, n=2)
    for index, now, reason in ((0, 101.0, None), (1, 101.0, None), (0, 104.0, "length")):
        collector.metrics.first_token_time = collector.metrics.first_token_time or now
        observer.on_output(collector, RequestOutputDelta(f"a-{index}", [7, 7], reason),
                           StreamDelta(index, "x", [7, 7], reason), now, now == 101.0)
    observer.on_aborted(collector, 105.0)  # the caller left: sample 1 aborted
    decode, tpot = observer.stats.request_decode_time, observer.stats.request_time_per_output_token
    assert (decode.count, decode.sum, tpot.count, tpot.sum) == (1, 3.0, 1, 1.0)  # sample 0: 101->104 over 4 - 1
    assert observer._samples == {} and observer.stats.e2e_request_latency.count == 1  # sample 0's alone


def test_every_request_histogram_observes_each_sample_as_vllms_child_requests() -> None:
    """n = 2, prompt of 3, sample 1 queued behind sample 0: vLLM's V1 observes each child request (its own stats,
    from the parent's arrival): time to first token, end-to-end latency, queue, prefill, inference and decode time,
    time per output token, prompt and generated tokens, once per sample, with the sample's own values."""
    observer = RequestObserver("m")
    collector = RequestCollector("q", 100.0, n=2)
    collector.prompt_token_ids = [1, 2, 3]
    metrics = collector.metrics
    events = {(0, 102.0): [EngineCoreEvent(QUEUED, 100.5), EngineCoreEvent(SCHEDULED, 101.0)],
              (1, 106.0): [EngineCoreEvent(QUEUED, 100.5), EngineCoreEvent(SCHEDULED, 105.0)]}
    for index, now, reason, first in ((0, 102.0, None, True), (0, 103.0, None, False), (0, 104.0, "length", False),
                                      (1, 106.0, None, True), (1, 107.0, "stop", False)):
        metrics.first_token_time = metrics.first_token_time or now
        metrics.num_generated_tokens += 1
        metrics.finished_time = now if index == 1 and reason is not None else None
        out = RequestOutputDelta(f"q-{index}", [7], reason, events=events.get((index, now)))
        observer.on_output(collector, out, StreamDelta(index, "x", [7], reason), now, first)
    stats = observer.stats
    observed = {name: (histogram.count, histogram.sum) for name, histogram in (
        ("ttft", stats.time_to_first_token), ("e2e", stats.e2e_request_latency), ("queue", stats.request_queue_time),
        ("prefill", stats.request_prefill_time), ("inference", stats.request_inference_time),
        ("decode", stats.request_decode_time), ("tpot", stats.request_time_per_output_token),
        ("prompt", stats.request_prompt_tokens), ("generation", stats.request_generation_tokens))}
    assert observed == {
        "ttft": (2, 8.0),  # 102 and 106 from the request's arrival at 100
        "e2e": (2, 11.0),  # 104 and 107 from 100
        "queue": (2, 5.0),  # 100.5 -> 101, 100.5 -> 105
        "prefill": (2, 2.0),  # 101 -> 102, 105 -> 106
        "inference": (2, 5.0),  # 101 -> 104, 105 -> 107
        "decode": (2, 3.0),  # 102 -> 104, 106 -> 107
        "tpot": (2, 2.0),  # 2 / (3 - 1), 1 / (2 - 1)
        "prompt": (2, 6.0),  # the prompt once per sample
        "generation": (2, 5.0),  # 3 and 2
    }
    assert stats.request_success == {"stop": 1, "length": 1, "abort": 0, "timeout": 0}
    assert (metrics.queue_time, metrics.prefill_time, metrics.inference_time) == (0.5, 1.0, 6.0)  # the request's
    assert observer._samples == {}
