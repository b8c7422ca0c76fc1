"""`RequestObserver`: the hooks the processor thread calls, feeding stats, metrics and spans.

Every method runs on the processor thread, once per request event or once per
output delta; none does I/O. The per-delta path (`on_output`) is a few
attribute updates and at most one histogram observation unless the request
finished or the core sent scheduling events. A span call that raises (the
host's sampler, span processor or exporter) is logged once per kind and
skipped: the host's tracing never ends a request or the processor thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from asyncllm.bundled import model_label
from asyncllm.metrics import multiprocess
from asyncllm.metrics.host_stats import HostStats
from asyncllm.metrics.prometheus import attach, retire
from asyncllm.metrics.request_timing import apply_events, observe_finished
from asyncllm.metrics.tracing import RequestTracer, span_operation, tracing_available
from asyncllm.outputs import RequestMetrics
from asyncllm.protocol import RequestOutputDelta, SchedulerStats

if TYPE_CHECKING:
    from asyncllm.engine.collector import RequestCollector
    from asyncllm.engine.processor_requests import Submit
    from asyncllm.outputs import StreamDelta

__all__ = ["RequestObserver"]

logger = logging.getLogger("asyncllm.engine")


_SPAN_CALL_VERBS = {"start": "started", "annotate": "annotated", "end": "ended"}


class _Traced:
    """A request's recording span and the finish reasons of its samples so far."""

    __slots__ = ("span", "finish_reasons")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.finish_reasons: list[str] = []


class _SampleSpans:
    """An n > 1 request's spans, one per sample (vLLM's child requests' spans), by sample index (None: not
    recording, or ended), with each sample's own metrics and cached prompt tokens from its first token on."""

    __slots__ = ("spans", "samples", "num_cached_tokens")

    def __init__(self, spans: list[Any]) -> None:
        self.spans = spans
        self.samples: list[RequestMetrics | None] = [None] * len(spans)
        self.num_cached_tokens = [0] * len(spans)

    def span_for(self, item: StreamDelta | BaseException) -> Any:
        """The span of the sample `item` came from; None for an error (it ends every unfinished sample's span
        failed, `on_error`: the error delta's core events, if any, go on none)."""
        return None if isinstance(item, BaseException) else self.spans[item.index]

    def open_spans(self) -> list[tuple[int, Any]]:
        return [(index, span) for index, span in enumerate(self.spans) if span is not None]


def _max_tokens_param(job: Submit) -> int | None:
    """The max_tokens its metrics and span record: the caller's (vLLM's ``max_tokens_param``), as the processor read
    it before the served max_model_len may cut ``job.params`` (`Submit.max_tokens_param`); None: unset."""
    return job.params.max_tokens if job.max_tokens_param is None else job.max_tokens_param


class RequestObserver:
    """Owns one engine's `HostStats`, its registry attachment and its request spans.

    A request with n > 1 samples runs as n core requests that share one
    collector: as vLLM's V1 runs it as n child requests, each with its own stats
    from the parent's arrival, every sample counts in the tokens and
    `request_success_total` and is observed in the request histograms on its own
    (its time to first token, inter-token latencies, and as it finishes its
    end-to-end, queue, prefill, decode, inference time, time per output token,
    prompt and generated tokens, its max_tokens: `_sample_tokens`, `_sample_finished`) and has its own span, as
    vLLM's output processor traces each child (`_SampleSpans`: its own events, first token, figures and finish);
    ``request_params_n`` and ``request_max_num_generation_tokens`` (vLLM's `ParentRequest`) see the request once,
    when its last sample finishes (the processor sets `metrics.finished_time` then).
    """

    def __init__(self, model_name: str, registry: Any = None, named: bool = True) -> None:
        """`named`: `model_name` is the model (False: an attached host's core address, until `set_model_name`);
        the bundled model's folder is labelled by its name (`model_label`)."""
        model_name = model_label(model_name)
        self.stats = HostStats(model_name, named)
        self.registry = attach(self.stats, registry)
        """The `CollectorRegistry` the metrics live in (the host's, or a private one)."""
        self._tracer = RequestTracer(model_name) if tracing_available() else None
        self._traced: dict[str, _Traced | _SampleSpans] = {}
        """request_id -> its span (n > 1: its samples'), only while the host has a tracer provider."""
        self.model_name: str | None = model_name if named else None
        """The model as named (a hub id, not the folder it resolved to; the bundled model's `asyncllm-tiny`): an
        attached host's is its core's launcher's (`set_model_name`; None until attached); `serve_as` keeps it."""
        self._served_name: str | None = None
        """The server's model name (`serve_as`), which no later `set_model_name` replaces."""
        self._span_failures: set[str] = set()
        """The kinds of span call ("start", "annotate", "end") that raised and were logged (once each)."""
        self._samples: dict[str, dict[str, RequestMetrics]] = {}
        """n > 1 requests' unfinished samples' own metrics (vLLM's child requests' stats), by core request id
        (`_sample`), until the sample or the request ends."""
        self._max_tokens: dict[str, int | None] = {}
        """Sampling requests' max_tokens (None: unset), by request id, for ``request_params_max_tokens``."""
        self._most_generated: dict[str, int] = {}
        """n > 1 requests: the most tokens one of their finished samples generated (vLLM's `ParentRequest`)."""
        self.max_model_len = 0
        """The core's (`Ready`): an unset max_tokens counts as max_model_len - the prompt's tokens, as vLLM's (a request
        the processor sent comes with it filled in from the served length: `Submit.max_tokens_param`)."""
        self._step_outputs = False
        """Whether the core message being processed (`on_step_start`) brought a request output."""

    def set_model_name(self, model_name: str) -> None:
        """Relabel metrics and spans (an attached host learns the model from the core), unless `serve_as` named
        them."""
        self.model_name = model_label(model_name)
        if self._served_name is None:
            self._label(self.model_name)

    def serve_as(self, served_name: str) -> None:
        """Label metrics and spans with the server's model name for good (`AsyncEngine.set_served_model_name`)."""
        self._served_name = served_name
        self._label(served_name)

    def _label(self, model_name: str) -> None:
        stats = self.stats

        def apply() -> None:
            stats.model_name, stats.named = model_name, True

        if stats.named and model_name != stats.model_name:  # its series may be written: they move to the new name
            multiprocess.relabel(stats.model_name, model_name, apply)
        else:
            apply()
        if self._tracer is not None:
            self._tracer.model_name = model_name

    def _span_call(self, kind: str, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)`, or None if it raised: the host's tracer provider runs its sampler (start) and span
        processors (end) inside these calls, and a bug of theirs must not end the processor thread."""
        try:
            return call(*args)
        except Exception:  # noqa: BLE001 - the host's code: logged once per kind, the request carries on
            if kind not in self._span_failures:
                self._span_failures.add(kind)
                logger.exception("asyncllm: the host's OpenTelemetry provider raised as a request span was %s; "
                                 "requests carry on (further such errors are not logged)", _SPAN_CALL_VERBS[kind])
            return None

    # ------------------------------------------------------------ request start
    def on_added(self, job: Submit) -> None:
        """The request was tokenized and sent to the core."""
        if job.options.pooling is None:
            self._max_tokens[job.collector.request_id] = _max_tokens_param(job)
        if self._tracer is not None:
            traced = self._start_traced(job, len(job.collector.prompt_token_ids))
            if traced is not None:
                self._traced[job.collector.request_id] = traced

    def on_rejected(self, job: Submit, error: BaseException, now: float) -> None:
        """The host refused the request before sending it (a bad prompt, a duplicate id)."""
        if self._tracer is not None:
            self._fail_spans(self._start_traced(job, 0), error, now)

    def _start_traced(self, job: Submit, num_prompt_tokens: int) -> _Traced | _SampleSpans | None:
        """The request's span, or an n > 1 request's spans, one per sample; None when none records."""
        num_samples = job.collector.num_samples
        if num_samples == 1:
            span = self._start_span(job, num_prompt_tokens, None)
            return None if span is None else _Traced(span)
        spans = [self._start_span(job, num_prompt_tokens, index) for index in range(num_samples)]
        return _SampleSpans(spans) if any(span is not None for span in spans) else None

    def _start_span(self, job: Submit, num_prompt_tokens: int, sample_index: int | None) -> Any:
        assert self._tracer is not None
        operation = span_operation(job.chat, job.options.pooling is not None)
        max_tokens = self._vllm_max_tokens(_max_tokens_param(job), num_prompt_tokens) if num_prompt_tokens else None
        return self._span_call("start", self._tracer.start, job.collector.request_id, job.params, operation,
                               num_prompt_tokens, job.trace_context, job.collector.metrics.arrival_time,
                               sample_index, max_tokens)

    # ------------------------------------------------------------ outputs
    def on_scheduler_stats(self, stats: SchedulerStats, reporter: bool) -> None:
        """The core's snapshot; `reporter` says whether this host exports the engine-wide series."""
        self.stats.take_snapshot(stats, reporter)
        multiprocess.resume()  # a forked child (gunicorn --preload) starts writing its series

    def on_step_start(self) -> int:
        """A core output message (one engine step's outputs for this host) is about to be processed: its token
        count so far, for `on_step_end`."""
        self._step_outputs = False
        return self.stats.prompt_tokens_total + self.stats.generation_tokens_total

    def on_step_end(self, tokens_before: int) -> None:
        """vLLM's ``iteration_tokens_total``: once per core output batch that brought a request output, the prompt
        tokens of the samples whose first token it brought plus the tokens it generated (a prefill chunk that ended
        no prompt brings no output; a batch of errors alone is 0, as vLLM's batch of outputs without tokens)."""
        if self._step_outputs:
            stats = self.stats
            stats.iteration_tokens.observe(stats.prompt_tokens_total + stats.generation_tokens_total - tokens_before)

    def on_output(self, collector: RequestCollector, out: RequestOutputDelta, item: StreamDelta | BaseException,
                  now: float, is_prefilling: bool) -> None:
        """One core output delta, after the processor turned it into `item`; `is_prefilling`: its sample had no
        token out before (its first tokens count the prompt, once per sample as vLLM's child requests)."""
        self._step_outputs = True
        metrics = collector.metrics
        sample = self._sample(collector, out.request_id) if collector.num_samples > 1 else None
        traced = self._traced.get(collector.request_id) if self._traced else None
        span = None if traced is None else traced.span if sample is None else traced.span_for(item)
        if out.events:
            apply_events(metrics, out.events)
            if sample is not None:
                apply_events(sample, out.events)
            if span is not None:
                self._span_call("annotate", RequestTracer.add_core_events, span, out.events)
        if isinstance(item, BaseException):
            self.on_error(collector, item, now)
            return
        pooled = out.embedding is not None
        if pooled:  # a pooling request's one delta: its sampled token is dropped, it generated nothing (vLLM's)
            metrics.num_generated_tokens = 0
        if out.new_token_ids:  # inline, not a call: the per-token path
            stats, last = self.stats, metrics.last_token_time
            if is_prefilling:
                stats.prompt_tokens_total += len(collector.prompt_token_ids)
            if span is not None and (last if sample is None else sample.last_token_time) is None:
                self._span_first_token(traced, span, sample, item, out, now)
            if sample is not None:
                self._sample_tokens(sample, now, 0 if pooled else len(out.new_token_ids))
            elif last is None:
                stats.time_to_first_token.observe(now - metrics.arrival_time)
            elif now != last:  # once per core step
                stats.inter_token_latency.observe(now - last)
            metrics.last_token_time = now
            stats.generation_tokens_total += 0 if pooled else len(out.new_token_ids)
        finish_reason = "stop" if pooled and item.finish_reason else item.finish_reason  # vLLM's pooling: STOP
        if finish_reason is not None:
            self.stats.count_finished(finish_reason)
            if sample is not None:
                self._sample_finished(collector, out.request_id, finish_reason, now, pooled)
                if span is not None:
                    self._end_sample_span(traced, item.index, sample, finish_reason, now, pooled)
            elif traced is not None:
                traced.finish_reasons.append(finish_reason)
            if metrics.finished_time is not None:  # the request's last sample
                self._on_request_finished(collector, finish_reason, now, pooled)

    def _span_first_token(self, traced: Any, span: Any, sample: RequestMetrics | None, item: StreamDelta,
                          out: RequestOutputDelta, now: float) -> None:
        """The first token of the request (n > 1: of the sample, whose metrics and cached tokens its span keeps)."""
        self._span_call("annotate", RequestTracer.first_token, span, now)
        if sample is not None:
            traced.samples[item.index], traced.num_cached_tokens[item.index] = sample, out.num_cached_tokens

    def _end_sample_span(self, traced: _SampleSpans, index: int, sample: RequestMetrics, finish_reason: str,
                         now: float, pooled: bool) -> None:
        """An n > 1 request's sample finished: its span ends with its own figures and finish reason, as vLLM's
        output processor traces each finished child request (`do_tracing`)."""
        span, traced.spans[index] = traced.spans[index], None
        sample.finished_time = now  # an aborted one's too: not observed, but its span has its e2e as a request's
        self._span_call("end", RequestTracer.finish, span, sample, [finish_reason], traced.num_cached_tokens[index],
                        now, pooled)

    def _sample(self, collector: RequestCollector, core_id: str) -> RequestMetrics:
        """An n > 1 request's sample's own metrics (vLLM's child request's `RequestStateStats`), from the request's
        arrival (vLLM's children carry their parent's arrival time)."""
        samples = self._samples.get(collector.request_id)
        if samples is None:
            samples = self._samples[collector.request_id] = {}
        sample = samples.get(core_id)
        if sample is None:
            sample = samples[core_id] = RequestMetrics(arrival_time=collector.metrics.arrival_time)
        return sample

    def _sample_tokens(self, sample: RequestMetrics, now: float, num_tokens: int) -> None:
        """An n > 1 request's sample's new tokens, as vLLM's child request's: its first observes its time to first
        token (from the request's arrival), a later one its inter-token latency, from its own token before (a
        sample queued behind the others has none for that wait: its first token is no inter-token latency)."""
        last = sample.last_token_time
        if last is None:
            sample.first_token_time = now
            self.stats.time_to_first_token.observe(now - sample.arrival_time)
        elif now != last:  # once per core step
            self.stats.inter_token_latency.observe(now - last)
        sample.last_token_time = now
        sample.num_generated_tokens += num_tokens

    def _sample_finished(self, collector: RequestCollector, core_id: str, finish_reason: str, now: float,
                         pooled: bool) -> None:
        """An n > 1 request's sample finished: the request histograms observe it on its own, as vLLM observes each
        child request (`observe_finished`: its end-to-end latency from the request's arrival, its own queue,
        prefill, decode and inference time, time per output token, the prompt's tokens and its own generated
        ones); an aborted one is not observed."""
        samples = self._samples.get(collector.request_id)
        sample = samples.pop(core_id, None) if samples is not None else None
        if sample is not None and finish_reason != "abort":
            sample.finished_time = now
            observe_finished(self.stats, sample, len(collector.prompt_token_ids), pooled)
            self._observe_max_tokens(collector)
            most = self._most_generated.get(collector.request_id, 0)
            self._most_generated[collector.request_id] = max(most, sample.num_generated_tokens)

    def _on_request_finished(self, collector: RequestCollector, finish_reason: str, now: float,
                             pooled: bool) -> None:
        self._samples.pop(collector.request_id, None)
        most_generated = self._most_generated.pop(collector.request_id, 0)
        if finish_reason != "abort":
            if collector.num_samples == 1:  # an n > 1 request's samples were, each
                observe_finished(self.stats, collector.metrics, len(collector.prompt_token_ids), pooled)
                self._observe_max_tokens(collector)
                most_generated = collector.metrics.num_generated_tokens
            self.stats.request_params_n.observe(collector.num_samples)  # vLLM's parent request, once
            self.stats.request_max_num_generation_tokens.observe(most_generated)
        self._max_tokens.pop(collector.request_id, None)
        traced = self._traced.pop(collector.request_id, None) if self._traced else None
        if isinstance(traced, _Traced):  # an n > 1 request's sample spans ended each as its sample finished
            self._span_call("end", RequestTracer.finish, traced.span, collector.metrics, traced.finish_reasons,
                            collector.num_cached_tokens, now, pooled)

    def _observe_max_tokens(self, collector: RequestCollector) -> None:
        """A finished sample's max_tokens, as vLLM's ``request_params_max_tokens``: an unset one is what vLLM sets
        it to (max_model_len - the prompt's tokens); a pooling request has none."""
        request_id = collector.request_id
        if request_id in self._max_tokens:
            max_tokens = self._vllm_max_tokens(self._max_tokens[request_id], len(collector.prompt_token_ids))
            if max_tokens is not None:
                self.stats.request_params_max_tokens.observe(max_tokens)

    def _vllm_max_tokens(self, max_tokens: int | None, num_prompt_tokens: int) -> int | None:
        """A sampling request's max_tokens as vLLM's server sets it: unset, max_model_len - the prompt's tokens (the
        length it runs to); None when that leaves none (or max_model_len is not known yet)."""
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
        return max_tokens if max_tokens > 0 else None

    # ------------------------------------------------------------ early ends
    def on_aborted(self, collector: RequestCollector, now: float) -> None:
        """The caller left, or the engine closed, before this sample finished (called once per sample)."""
        self.stats.count_finished("abort")
        self._samples.pop(collector.request_id, None)
        self._max_tokens.pop(collector.request_id, None)
        self._most_generated.pop(collector.request_id, None)
        traced = self._traced.pop(collector.request_id, None) if self._traced else None
        if isinstance(traced, _Traced):
            reasons = [*traced.finish_reasons, "abort"]  # the samples' that finished before, as a finished span's
            self._span_call("end", RequestTracer.cancel, traced.span, collector.metrics, reasons, now)
        elif traced is not None:  # the first call ends every unfinished sample's span (the others find none)
            for index, span in traced.open_spans():
                metrics = traced.samples[index] or RequestMetrics(arrival_time=collector.metrics.arrival_time)
                self._span_call("end", RequestTracer.cancel, span, metrics, ["abort"], now)

    def on_ended_unsent(self, job: Submit, error: BaseException | None, now: float) -> None:
        """The request ended before it was sent to the core (parked while its adapter was checked: asyncllm/engine/
        processor_lora.py), counted as a sent one that ended so: each sample aborted (None: the caller left, or the
        engine closed) or failed with `error`; its span (n > 1: each sample's) starts and ends at once."""
        if self._tracer is not None:
            traced = self._start_traced(job, 0)
            if traced is not None:  # an id in flight is refused, parked ones' too: none other has this key
                self._traced[job.collector.request_id] = traced
        for _ in range(job.params.n):
            if error is None:
                self.on_aborted(job.collector, now)
            else:
                self.on_error(job.collector, error, now)

    def on_error(self, collector: RequestCollector, error: BaseException, now: float) -> None:
        """The request failed (the core refused it, or the engine died); safe to call once per sample."""
        self._samples.pop(collector.request_id, None)
        self._max_tokens.pop(collector.request_id, None)
        self._most_generated.pop(collector.request_id, None)
        self._fail_spans(self._traced.pop(collector.request_id, None) if self._traced else None, error, now)

    def _fail_spans(self, traced: _Traced | _SampleSpans | None, error: BaseException, now: float) -> None:
        """End the request's span failed (n > 1: each unfinished sample's)."""
        if isinstance(traced, _Traced):
            self._span_call("end", RequestTracer.fail, traced.span, error, now)
        elif traced is not None:
            for _, span in traced.open_spans():
                self._span_call("end", RequestTracer.fail, span, error, now)

    def on_closed(self) -> None:
        """The engine closed for good: its counters stay in the registry's summed series, its gauges leave."""
        self.stats.mark_closed()
        retire(self.stats, self.registry)
