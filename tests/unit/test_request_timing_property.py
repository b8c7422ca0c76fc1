"""Model-based property test of per-request timing (asyncllm/metrics/request_timing.py).

Drawn: one request (a generation request, or a pooling one: one delta), its arrival at a `time.time()`-sized
host clock, and its output deltas as the core sends them (a delta carries tokens or the finish, never neither:
asyncllm/sched/update_each.py), each with 0 to 3 tokens (speculative decoding's several per step), 0 to 3 core
events of any type in any order (QUEUED, SCHEDULED, PREEMPTED: preemptions before and after the first token, a
second SCHEDULED after one), host steps of 0 s (ties) to 2.5 s landing on bucket bounds, core timestamps that
lag the delta's host time by a drawn amount on a core clock offset from the host's by a drawn skew (0, ahead,
behind: a core time may be after the host's first or last token), and a finish reason (stop, length, abort,
timeout), the last delta possibly carrying no token (a request that finishes before its first token).

Played as the processor thread does (asyncllm/engine/processor_outputs.py stamps the first token, the token
count and the finish, then `RequestObserver.on_output`, which calls `apply_events` and `observe_finished`).

The model is vLLM v1's request stats (`RequestStateStats`, `FinishedRequestStats`) with the divergences that
docs/observability.md and the module decide: the queued and first scheduled times are the earliest event's
(vLLM: the first SCHEDULED received, the last QUEUED; equal for events in order); a request finished `abort`
observes nothing; one finished with no token observes no prefill, decode or inference time and a time per
output token of 0; a pooling request no decode time; queue, prefill, decode and inference times below 0 (a
skewed core clock) are observed as 0 (vLLM observes them as they are), end to end and time to first token as
they are; an inter-token latency per later token delta at a new host time. It holds every `RequestMetrics`
field and the count, sum and buckets of the ten timing histograms equal to the model's exactly (the model
computes with the same float operations, so no tolerance is needed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.engine.collector import RequestCollector
from asyncllm.metrics.host_stats import Histogram
from asyncllm.metrics.observer import RequestObserver
from asyncllm.outputs import RequestMetrics, StreamDelta
from asyncllm.protocol import EngineCoreEvent, EngineCoreEventType, RequestOutputDelta

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "300"))
QUEUED, SCHEDULED, PREEMPTED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED
ARRIVAL = 1_765_000_000.0
"""A `time.time()`-sized clock: differences round as the engine's do."""
STEPS = (0.0, 0.0, 0.001, 0.01, 0.25, 0.3, 0.5, 1.0, 2.5)
"""Host clock steps between deltas: ties, and sums landing on bucket bounds."""
LAGS = (0.0, 0.0, 0.001, 0.2, 0.3, 1.0, 3.0)
"""How long before its delta's host time the core stamped an event (on the core's clock)."""
SKEWS = (0.0, 0.0, 0.5, -0.5, 4.0, -4.0)
"""The core clock minus the host clock."""
TIMING_HISTOGRAMS = ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time",
                     "request_prefill_time", "request_decode_time", "request_inference_time",
                     "request_time_per_output_token", "request_prompt_tokens", "request_generation_tokens")


@dataclass(frozen=True)
class Delta:
    """One core output delta: host step before it, its tokens, its events as (type, lag), its finish."""

    step: float
    num_tokens: int
    events: tuple[tuple[EngineCoreEventType, float], ...]
    finish_reason: str | None


@dataclass(frozen=True)
class Case:
    prompt_len: int
    skew: float
    pooled: bool
    deltas: tuple[Delta, ...]


events = st.lists(st.tuples(st.sampled_from((QUEUED, SCHEDULED, PREEMPTED)), st.sampled_from(LAGS)), max_size=3)
reasons = st.sampled_from(("stop", "length", "abort", "timeout"))


@st.composite
def cases(draw) -> Case:
    """A request's deltas: running ones with 1 to 3 tokens, then the finishing one with 0 to 3 (pooled: one delta
    with one token, the one the engine samples to run it)."""
    pooled = draw(st.booleans()) and draw(st.booleans())
    running = [] if pooled else draw(st.lists(st.tuples(st.sampled_from(STEPS), st.integers(1, 3), events),
                                              max_size=5))
    deltas = [Delta(step, n, tuple(evs), None) for step, n, evs in running]
    last_tokens = 1 if pooled else draw(st.integers(0, 3))
    reason = draw(st.sampled_from(("stop", "length")) if pooled else reasons)  # a pooled result is a success
    deltas.append(Delta(draw(st.sampled_from(STEPS)), last_tokens, tuple(draw(events)), reason))
    return Case(draw(st.integers(1, 40)), draw(st.sampled_from(SKEWS)), pooled, tuple(deltas))


def host_times(case: Case) -> list[float]:
    """Each delta's host receive time (non-decreasing, from the arrival)."""
    times, now = [], ARRIVAL
    for delta in case.deltas:
        now += delta.step
        times.append(now)
    return times


def core_events(case: Case, delta: Delta, now: float) -> list[EngineCoreEvent]:
    return [EngineCoreEvent(kind, now + case.skew - lag) for kind, lag in delta.events]


def play(case: Case) -> tuple[RequestObserver, RequestCollector]:
    """The processor thread's path for each delta (`_on_delta` / `_process_output`), then the observer's."""
    observer = RequestObserver("m")
    collector = RequestCollector("r", ARRIVAL)
    collector.prompt_token_ids = [1] * case.prompt_len
    metrics, is_prefilling = collector.metrics, True
    for delta, now in zip(case.deltas, host_times(case)):
        tokens = [7] * delta.num_tokens
        out = RequestOutputDelta("r", tokens, delta.finish_reason, events=core_events(case, delta, now) or None,
                                 embedding=b"\0" * 8 if case.pooled else None)
        if tokens and metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.num_generated_tokens += len(tokens)
        if delta.finish_reason is not None:
            metrics.finished_time = now
        observer.on_output(collector, out, StreamDelta(0, "x", tokens, delta.finish_reason), now, is_prefilling)
        is_prefilling = is_prefilling and not tokens
    return observer, collector


def expected_metrics(case: Case) -> RequestMetrics:
    """vLLM's `RequestStateStats` folded from the same deltas, with the earliest QUEUED and SCHEDULED."""
    times = host_times(case)
    all_events = [e for delta, now in zip(case.deltas, times) for e in core_events(case, delta, now)]
    queued = [e.timestamp for e in all_events if e.type == QUEUED]
    scheduled = [e.timestamp for e in all_events if e.type == SCHEDULED]
    token_times = [now for delta, now in zip(case.deltas, times) if delta.num_tokens]
    return RequestMetrics(
        arrival_time=ARRIVAL, first_token_time=token_times[0] if token_times else None, finished_time=times[-1],
        num_generated_tokens=0 if case.pooled else sum(d.num_tokens for d in case.deltas),
        queued_time=min(queued, default=None), first_scheduled_time=min(scheduled, default=None),
        last_token_time=token_times[-1] if token_times else None,
        num_preemptions=sum(e.type == PREEMPTED for e in all_events))


def expected_observations(case: Case, m: RequestMetrics) -> dict[str, list[float]]:
    """What each timing histogram observes, in order (docs/observability.md, the request histograms)."""
    token_times = [now for delta, now in zip(case.deltas, host_times(case)) if delta.num_tokens]
    seen: dict[str, list[float]] = {name: [] for name in TIMING_HISTOGRAMS}
    if token_times:
        seen["time_to_first_token"].append(token_times[0] - ARRIVAL)
    seen["inter_token_latency"] = [b - a for a, b in zip(token_times, token_times[1:]) if b != a]
    if case.deltas[-1].finish_reason == "abort":
        return seen
    seen["e2e_request_latency"].append(m.finished_time - ARRIVAL)
    seen["request_prompt_tokens"].append(case.prompt_len)
    seen["request_generation_tokens"].append(m.num_generated_tokens)
    pairs = (("request_queue_time", m.queued_time, m.first_scheduled_time),
             ("request_prefill_time", m.first_scheduled_time, m.first_token_time),
             ("request_inference_time", m.first_scheduled_time, m.last_token_time))
    for name, start, end in pairs:
        if start is not None and end is not None:
            seen[name].append(max(end - start, 0.0))
    decode = None if case.pooled or not token_times else max(m.last_token_time - m.first_token_time, 0.0)
    if decode is not None:
        seen["request_decode_time"].append(decode)
    n = m.num_generated_tokens
    seen["request_time_per_output_token"].append(decode / (n - 1) if decode is not None and n > 1 else 0.0)
    return seen


def observed(histogram: Histogram, values: list[float]) -> tuple[list[int], float]:
    """The counts and sum a histogram with `histogram`'s bounds has after observing `values` in order."""
    model = Histogram(histogram.bounds)
    for value in values:
        model.observe(value)
    return model.counts, model.sum


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@given(cases())
@example(Case(3, -4.0, False, (  # a core clock behind: preempted after its first token, rescheduled; ties
    Delta(0.3, 2, ((QUEUED, 0.3), (SCHEDULED, 0.001)), None), Delta(0.0, 1, ((PREEMPTED, 0.0),), None),
    Delta(0.5, 3, ((SCHEDULED, 0.2),), None), Delta(0.0, 0, (), "length"))))
@example(Case(5, 4.0, False, (Delta(1.0, 0, ((SCHEDULED, 0.0), (QUEUED, 1.0), (PREEMPTED, 0.0)), "stop"),)))
@example(Case(2, 0.0, True, (Delta(0.25, 1, ((QUEUED, 0.2), (SCHEDULED, 0.0)), "length"),)))
def test_request_metrics_and_timing_histograms_match_vllms_request_stats(case: Case) -> None:
    observer, collector = play(case)
    model = expected_metrics(case)
    assert collector.metrics == model
    for name, values in expected_observations(case, model).items():
        histogram = getattr(observer.stats, name)
        assert (histogram.counts, histogram.sum) == observed(histogram, values), name
