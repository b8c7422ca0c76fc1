"""Per-request timing: the core's scheduling events -> `RequestMetrics` -> histograms.

The engine core timestamps QUEUED, SCHEDULED and PREEMPTED events with its
time.time() and sends them on the request's next output delta (most deltas
carry none). The host stamps arrival, first token, each token and the finish.
Both clocks are the same machine's wall clock; across machines (TCP) a clock
offset moves time between the queue and prefill figures, nothing else.

    arrival --(tokenize, send)--> queued --queue_time--> first scheduled
      --prefill_time--> first token --decode_time--> last token = finished
    time_to_first_token = first token - arrival;  e2e_latency = finished - arrival
"""

from __future__ import annotations

from asyncllm.metrics.host_stats import HostStats
from asyncllm.outputs import RequestMetrics
from asyncllm.protocol import EngineCoreEvent, EngineCoreEventType

__all__ = ["apply_events", "observe_decode", "observe_finished"]

_QUEUED, _SCHEDULED, _PREEMPTED = (
    EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED)


def apply_events(metrics: RequestMetrics, events: list[EngineCoreEvent]) -> None:
    """Fold one delta's core events into the request's metrics."""
    for event in events:
        if event.type == _SCHEDULED:  # the earliest: an n > 1 request's samples' events come in any order
            if metrics.first_scheduled_time is None or event.timestamp < metrics.first_scheduled_time:
                metrics.first_scheduled_time = event.timestamp
        elif event.type == _PREEMPTED:
            metrics.num_preemptions += 1
        elif event.type == _QUEUED:  # each sample's of an n > 1 request: the first, as the first scheduled
            if metrics.queued_time is None or event.timestamp < metrics.queued_time:
                metrics.queued_time = event.timestamp


def observe_finished(stats: HostStats, metrics: RequestMetrics, num_prompt_tokens: int, pooled: bool = False) -> None:
    """Record a request that finished with a reason other than abort in the request histograms: one vLLM request's
    `FinishedRequestStats` (an n > 1 request's sample's own metrics, as each finishes: vLLM's child request's,
    `RequestObserver`). A pooling request (`pooled`) has no decode time."""
    assert metrics.finished_time is not None
    stats.e2e_request_latency.observe(metrics.finished_time - metrics.arrival_time)
    stats.request_prompt_tokens.observe(num_prompt_tokens)
    stats.request_generation_tokens.observe(metrics.num_generated_tokens)
    decode_time = None if pooled else metrics.decode_time
    for histogram, value in (
        (stats.request_queue_time, metrics.queue_time),
        (stats.request_prefill_time, metrics.prefill_time),
        (stats.request_inference_time, metrics.inference_time),
    ):
        if value is not None:
            histogram.observe(max(value, 0.0))
    observe_decode(stats, decode_time, metrics.num_generated_tokens)


def observe_decode(stats: HostStats, decode_time: float | None, num_generated_tokens: int) -> None:
    """One finished vLLM request's decode time, its first token to its last (None: no token, or a pooling request:
    not observed), and vLLM's mean time per output token: decode time / (tokens - 1), 0 for one token or none
    (``mean_time_per_output_token``)."""
    if decode_time is not None:
        stats.request_decode_time.observe(max(decode_time, 0.0))
    decoded = decode_time is not None and num_generated_tokens > 1
    stats.request_time_per_output_token.observe(max(decode_time, 0.0) / (num_generated_tokens - 1) if decoded else 0.0)
