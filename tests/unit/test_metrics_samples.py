"""An n > 1 request's samples in the request timing and histograms, without an engine: each observed on its own, as
vLLM's V1 observes each child request (vllm/v1/metrics/stats.py, `IterationStats`)."""

from __future__ import annotations

from asyncllm import PoolingParams, SamplingParams
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.processor_requests import Submit
from asyncllm.engine.stream import RequestOptions
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


def _sent(observer: RequestObserver, request_id: str, n: int, max_tokens: int | None, prompt_len: int = 3,
          pooling: PoolingParams | None = None) -> RequestCollector:
    collector = RequestCollector(request_id, 100.0, n=n)
    collector.prompt_token_ids = [1] * prompt_len
    observer.on_added(Submit(collector, collector.prompt_token_ids, SamplingParams(n=n, max_tokens=max_tokens),
                             RequestOptions(pooling=pooling)))
    return collector


def _finish(observer: RequestObserver, collector: RequestCollector, index: int, tokens: int, reason: str,
            last: bool) -> None:
    """Sample `index`'s `tokens` tokens in one delta, ending it with `reason` (`last`: the request's last sample)."""
    collector.metrics.first_token_time = collector.metrics.first_token_time or 101.0
    collector.metrics.num_generated_tokens += tokens
    collector.metrics.finished_time = 102.0 if last else None
    core_id = f"{collector.request_id}-{index}" if collector.num_samples > 1 else collector.request_id
    observer.on_output(collector, RequestOutputDelta(core_id, [7] * tokens, reason),
                       StreamDelta(index, "x", [7] * tokens, reason), 101.0 + index, True)


def test_params_n_and_max_num_generation_tokens_are_observed_once_per_request_as_vllms_parent_request() -> None:
    """vLLM's `ParentRequest.observe_finished_request`: when the last sample finishes, n and the most tokens one sample
    generated (n = 1: its own); a request whose samples were aborted (the caller left) is never observed."""
    observer = RequestObserver("m")
    pair = _sent(observer, "p", 2, 6)
    _finish(observer, pair, 0, 3, "stop", last=False)
    stats = observer.stats
    assert (stats.request_params_n.count, stats.request_max_num_generation_tokens.count) == (0, 0)  # one unfinished
    _finish(observer, pair, 1, 2, "length", last=True)
    single = _sent(observer, "s", 1, 4)
    _finish(observer, single, 0, 4, "length", last=True)
    left = _sent(observer, "a", 2, 5)
    _finish(observer, left, 0, 5, "length", last=False)
    observer.on_aborted(left, 103.0)  # sample 1 aborted: vLLM's parent never sees its last child finish
    assert (stats.request_params_n.count, stats.request_params_n.sum) == (2, 3.0)  # 2 and 1
    assert stats.request_params_n.counts[:2] == [1, 1]  # le=1: the n = 1 request, le=2: the pair
    assert (stats.request_max_num_generation_tokens.count, stats.request_max_num_generation_tokens.sum) == (2, 7.0)
    assert observer._most_generated == {} and observer._max_tokens == {}


def test_params_max_tokens_is_observed_per_finished_sample_and_an_unset_one_as_vllm_sets_it() -> None:
    """vLLM's `request_params_max_tokens`: per finished (not aborted) sample, its max_tokens; vLLM sets an unset one
    to max_model_len - the prompt's tokens; a pooling request has none."""
    observer = RequestObserver("m")
    observer.max_model_len = 64
    pair = _sent(observer, "p", 2, 6)
    _finish(observer, pair, 0, 3, "stop", last=False)
    _finish(observer, pair, 1, 6, "length", last=True)
    unset = _sent(observer, "u", 1, None, prompt_len=4)
    _finish(observer, unset, 0, 2, "stop", last=True)
    left = _sent(observer, "a", 1, 9)
    observer.on_aborted(left, 103.0)
    pooled = _sent(observer, "e", 1, None, pooling=PoolingParams())
    pooled.metrics.finished_time = 102.0
    observer.on_output(pooled, RequestOutputDelta("e", [7], "stop", embedding=b"\0\0\0\0"),
                       StreamDelta(0, "", [], "stop"), 102.0, True)
    histogram = observer.stats.request_params_max_tokens
    assert (histogram.count, histogram.sum) == (3, 72.0)  # 6, 6 and 64 - 4
    assert (observer.stats.request_params_n.count, observer.stats.request_max_num_generation_tokens.sum) == (3, 8.0)


def test_iteration_tokens_observe_each_core_message_with_outputs_as_vllms_engine_step() -> None:
    """vLLM's `iteration_tokens_total`, once per output batch with outputs: the prompt tokens of the samples whose
    first token it brought plus its generated tokens; a message without outputs (stats alone) is no observation."""
    observer = RequestObserver("m")
    a, b = _sent(observer, "a", 1, 8, prompt_len=5), _sent(observer, "b", 2, 8, prompt_len=3)
    step = observer.on_step_start()
    for collector, core_id, first in ((a, "a", True), (b, "b-0", True), (b, "b-1", True)):
        observer.on_output(collector, RequestOutputDelta(core_id, [7]), StreamDelta(0, "x", [7]), 101.0, first)
    observer.on_step_end(step)
    step = observer.on_step_start()
    observer.on_output(a, RequestOutputDelta("a", [7, 8]), StreamDelta(0, "x", [7, 8]), 102.0, False)
    observer.on_step_end(step)
    observer.on_step_end(observer.on_step_start())  # the core's snapshot alone
    histogram = observer.stats.iteration_tokens
    assert (histogram.count, histogram.sum) == (2, 16.0)  # 5 + 3 + 3 + 3 tokens, then 2
    assert histogram.counts[:3] == [0, 1, 1]  # le=1: none, le=8: the 2, le=16: the 14
