"""Model-based property test of the host-side request metrics (`RequestObserver` -> `HostStats` -> Prometheus).

A drawn script of concurrent requests (n = 1..3 samples, pooling ones, drawn prompt lengths and max_tokens) is
played through `RequestObserver` the way the processor thread calls it (asyncllm/engine/processor_outputs.py:
`on_step_start`, one `on_output` per delta with the processor's `is_prefilling` and `RequestMetrics` bookkeeping,
`on_step_end`; `on_aborted` / `on_error` per unfinished sample when the caller leaves or the engine dies), with
drawn core events (queued, scheduled, preempted), clock ticks (0 s ticks: two steps at one time), token deltas of
drawn sizes, and every finish reason (stop, length, abort, timeout, a core error). A plain model computes from the
same script, following docs/observability.md (vLLM's metric meanings: per-sample observation of n > 1 requests,
aborted samples unobserved, `request_params_n` once per request, pooling requests, `iteration_tokens_total` per
step), every counter and every histogram's count, sum and `le` bucket counts; they are compared with `HostStats`,
`stats()`'s snapshot and the scraped Prometheus text (parsed by prometheus_client.parser). Counts are exact, sums
within a float tolerance. The buckets are written out here from vLLM's (docs: "Histogram buckets are vLLM's").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asyncllm import PoolingParams, SamplingParams
from asyncllm.engine.collector import RequestCollector
from asyncllm.engine.processor_requests import Submit
from asyncllm.engine.stream import RequestOptions
from asyncllm.metrics.observer import RequestObserver
from asyncllm.outputs import StreamDelta
from asyncllm.protocol import EngineCoreEvent, EngineCoreEventType, RequestOutputDelta, SchedulerStats

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "100"))
PHASES = [phase for phase in Phase if phase != Phase.shrink or not os.environ.get("PROP_NO_SHRINK")]
QUEUED, SCHEDULED, PREEMPTED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED

TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0)
ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0)
LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0)
TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKENS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
ITERATION = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
N_BOUNDS = (1.0, 2.0, 5.0, 10.0, 20.0)
HISTOGRAMS = {  # HostStats attribute: (exported name, vLLM's bounds)
    "time_to_first_token": ("time_to_first_token_seconds", TTFT),
    "inter_token_latency": ("inter_token_latency_seconds", ITL),
    "e2e_request_latency": ("e2e_request_latency_seconds", LATENCY),
    "request_queue_time": ("request_queue_time_seconds", LATENCY),
    "request_prefill_time": ("request_prefill_time_seconds", LATENCY),
    "request_decode_time": ("request_decode_time_seconds", LATENCY),
    "request_inference_time": ("request_inference_time_seconds", LATENCY),
    "request_time_per_output_token": ("request_time_per_output_token_seconds", TPOT),
    "request_prompt_tokens": ("request_prompt_tokens", TOKENS),
    "request_generation_tokens": ("request_generation_tokens", TOKENS),
    "request_max_num_generation_tokens": ("request_max_num_generation_tokens", TOKENS),
    "request_params_n": ("request_params_n", N_BOUNDS),
    "request_params_max_tokens": ("request_params_max_tokens", TOKENS),
    "iteration_tokens": ("iteration_tokens_total", ITERATION),
}
REASONS = ("stop", "length", "abort", "timeout")


# ------------------------------------------------------------------ the script
DT = (0.25, 0.5, 0.0, 0.001, 0.1, 0.125, 0.3, 1.0, 2.5)
FRACTIONS = (0.0, 0.25, 0.5, 1.0)
_delta = st.tuples(st.integers(0, 30), st.integers(0, 3), st.sampled_from((*[None] * 8, *REASONS, "error")),
                   st.integers(0, 6), st.sampled_from(FRACTIONS), st.sampled_from(FRACTIONS))
"""(which live sample, tokens, finish reason or "error", events code, queued / scheduled fractions)."""
_add = st.tuples(st.just("add"), st.sampled_from((1, 1, 2, 3)), st.sampled_from((1, 2, 3, 5, 10, 20)),
                 st.sampled_from((None, 1, 2, 5, 7, 20)), st.sampled_from((False, False, False, True)),
                 st.sampled_from((0.0, 0.25, 0.5)))
_step = st.tuples(st.just("step"), st.lists(_delta, min_size=1, max_size=5), st.sampled_from(DT))
_tick = st.tuples(st.just("tick"), st.sampled_from(DT))
_rare = st.one_of(_tick, st.tuples(st.just("abort"), st.integers(0, 30)),
                  st.tuples(st.just("fail"), st.integers(0, 30)),
                  st.tuples(st.just("stats"), st.lists(st.integers(1, 50), min_size=5, max_size=5), st.booleans()))
_round = st.tuples(st.integers(0, 3), _add, _step, st.integers(0, 4), _rare).map(
    lambda t: [t[1]] * (t[0] == 0) + [t[2]] + [t[4]] * (t[3] == 0))
"""Mostly a core step; now and then a new request before it, an abort, an engine death, a snapshot or a tick."""
_close = st.lists(st.tuples(st.just("close"), st.booleans()), max_size=1)
SCRIPTS = st.tuples(st.sampled_from((0, 8, 20, 64)), st.lists(_add, min_size=1, max_size=4),
                    st.lists(_round, min_size=1, max_size=15), _close).map(
    lambda t: (t[0], t[1] + [action for round_ in t[2] for action in round_] + t[3]))
"""(max_model_len, actions): a first batch of requests, then anything, maybe the engine's close at the end."""


# ------------------------------------------------------------------ the model (and the processor's bookkeeping)
@dataclass
class Sample:
    index: int
    core_id: str
    prefilling: bool = True
    tokens: int = 0
    first: float | None = None
    last: float | None = None
    queued: float | None = None
    sched: float | None = None
    done: bool = False


@dataclass
class Req:
    rid: str
    n: int
    prompt: int
    max_tokens: int | None
    pooled: bool
    arrival: float
    collector: RequestCollector
    samples: list[Sample]
    most: int = 0
    ended: bool = False
    queued: float | None = None
    sched: float | None = None
    preemptions: int = 0

    def live(self) -> list[Sample]:
        return [] if self.ended else [s for s in self.samples if not s.done]


@dataclass
class Model:
    max_model_len: int
    seen: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in HISTOGRAMS})
    prompt_total: int = 0
    gen_total: int = 0
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    step_tokens: int = 0

    def tokens(self, req: Req, s: Sample, k: int, now: float) -> None:
        if s.prefilling:  # the prompt, once per sample, at its first token
            self.prompt_total += req.prompt
            self.step_tokens += req.prompt
        s.prefilling = False
        if s.first is None:
            s.first = now
            self.seen["time_to_first_token"].append(now - req.arrival)
        elif now != s.last:  # one inter-token latency per core step, from the sample's own token before
            self.seen["inter_token_latency"].append(now - s.last)
        s.last = now
        generated = 0 if req.pooled else k
        s.tokens += generated
        self.gen_total += generated
        self.step_tokens += generated

    def finished(self, req: Req, s: Sample, reason: str, now: float) -> None:
        s.done = True
        self.success[reason] = self.success.get(reason, 0) + 1
        if reason != "abort":
            self.observe_sample(req, s, now)
            req.most = max(req.most, s.tokens)
        if all(x.done for x in req.samples) and reason != "abort":  # vLLM's parent request, once
            self.seen["request_params_n"].append(req.n)
            self.seen["request_max_num_generation_tokens"].append(req.most)

    def observe_sample(self, req: Req, s: Sample, now: float) -> None:
        seen = self.seen
        seen["e2e_request_latency"].append(now - req.arrival)
        seen["request_prompt_tokens"].append(req.prompt)
        seen["request_generation_tokens"].append(s.tokens)
        for name, start, end in (("request_queue_time", s.queued, s.sched),
                                 ("request_prefill_time", s.sched, s.first),
                                 ("request_inference_time", s.sched, s.last)):
            if start is not None and end is not None:
                seen[name].append(max(end - start, 0.0))
        decode = None if req.pooled or s.first is None else max(s.last - s.first, 0.0)
        if decode is not None:
            seen["request_decode_time"].append(decode)
        seen["request_time_per_output_token"].append(decode / (s.tokens - 1) if decode is not None and s.tokens > 1
                                                     else 0.0)
        if not req.pooled:
            max_tokens = req.max_tokens if req.max_tokens is not None else self.max_model_len - req.prompt
            if max_tokens > 0:
                seen["request_params_max_tokens"].append(max_tokens)


# ------------------------------------------------------------------ playing the script
class Player:
    def __init__(self, max_model_len: int) -> None:
        self.observer = RequestObserver("m")
        self.observer.max_model_len = max_model_len
        self.model = Model(max_model_len)
        self.now = 100.0
        self.reqs: list[Req] = []
        self.last_stats: SchedulerStats | None = None
        self.reporter = self.closed = self.owns = False

    def live(self) -> list[tuple[Req, Sample]]:
        return [(r, s) for r in self.reqs for s in r.live()]

    def live_reqs(self) -> list[Req]:
        return [r for r in self.reqs if r.live()]

    def add(self, n: int, prompt: int, max_tokens: int | None, pooled: bool, back: float) -> None:
        n = 1 if pooled else n
        rid = f"r{len(self.reqs)}"
        collector = RequestCollector(rid, self.now - back, n=n)
        collector.prompt_token_ids = [1] * prompt
        samples = [Sample(i, rid if n == 1 else f"{rid}-{i}") for i in range(n)]
        self.reqs.append(Req(rid, n, prompt, max_tokens, pooled, self.now - back, collector, samples))
        options = RequestOptions(pooling=PoolingParams() if pooled else None)
        self.observer.on_added(Submit(collector, collector.prompt_token_ids,
                                      SamplingParams(n=n, max_tokens=max_tokens), options))

    def step(self, deltas: list[tuple], dt: float = 0.0) -> None:
        """One core output message, `dt` after the previous action."""
        self.now += dt
        self.model.step_tokens, outputs, used = 0, False, set()
        before = self.observer.on_step_start()
        for pick, k, reason, code, a, b in deltas:
            live = [(r, s) for r, s in self.live() if s.core_id not in used]
            if not live:
                continue
            req, s = live[pick % len(live)]
            if req.pooled:  # a pooling request's one delta: one sampled token, finished
                k, reason = 1, "error" if reason == "error" else "stop" if reason == "stop" else "length"
            if k == 0 and reason is None:
                continue  # no token, no finish: the processor drops the delta
            used.add(s.core_id)
            outputs = True
            self.deliver(req, s, k, reason, self.events(req, s, code, a, b))
        self.observer.on_step_end(before)
        if outputs:
            self.model.seen["iteration_tokens"].append(self.model.step_tokens)

    def events(self, req: Req, s: Sample, code: int, a: float, b: float) -> list[EngineCoreEvent] | None:
        """First delta: maybe queued and scheduled (between arrival and now); later: maybe a preemption and a
        later rescheduling (not the first scheduled time)."""
        now = self.now
        if s.prefilling and code >= 2:
            queued = req.arrival + (now - req.arrival) * a
            scheduled = queued + (now - queued) * b
            s.queued = queued if s.queued is None else min(s.queued, queued)
            s.sched = scheduled if s.sched is None else min(s.sched, scheduled)
            req.queued = queued if req.queued is None else min(req.queued, queued)  # the earliest sample's
            req.sched = scheduled if req.sched is None else min(req.sched, scheduled)
            return [EngineCoreEvent(QUEUED, queued), EngineCoreEvent(SCHEDULED, scheduled)]
        if not s.prefilling and code == 1 and s.sched is not None:
            req.preemptions += 1
            return [EngineCoreEvent(PREEMPTED, now), EngineCoreEvent(SCHEDULED, now + 0.5)]
        return None

    def deliver(self, req: Req, s: Sample, k: int, reason: str | None, events: list | None) -> None:
        metrics, now, prefilling = req.collector.metrics, self.now, s.prefilling
        if reason == "error":  # the core refused the request: the processor ends every sample of it
            out = RequestOutputDelta(s.core_id, [], "abort", error="boom", events=events)
            req.ended = True
            self.observer.on_output(req.collector, out, RuntimeError("boom"), now, prefilling)
            return
        tokens = [7] * k
        if tokens:
            self.model.tokens(req, s, k, now)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
        metrics.num_generated_tokens += k
        if reason is not None and all(x.done or x is s for x in req.samples):
            metrics.finished_time = now  # the request's last sample
        out = RequestOutputDelta(s.core_id, tokens, reason, events=events,
                                 embedding=b"\0" * 8 if req.pooled else None)
        self.observer.on_output(req.collector, out, StreamDelta(s.index, "x", tokens, reason), now, prefilling)
        if reason is not None:  # a pooling request finishes "stop", as vLLM's
            self.model.finished(req, s, "stop" if req.pooled else reason, now)

    def abort(self, pick: int) -> None:
        """The caller left: `on_aborted` once per unfinished sample, each counted `abort`, none observed."""
        reqs = self.live_reqs()
        if reqs:
            req = reqs[pick % len(reqs)]
            for _ in req.live():
                self.observer.on_aborted(req.collector, self.now)
                self.model.success["abort"] += 1
            req.ended = True

    def fail(self, pick: int) -> None:
        """The engine died under the request: `on_error` once per unfinished sample, no finish reason counted."""
        reqs = self.live_reqs()
        if reqs:
            req = reqs[pick % len(reqs)]
            for _ in req.live():
                self.observer.on_error(req.collector, RuntimeError("dead"), self.now)
            req.ended = True

    def stats(self, values: list[int], reporter: bool) -> None:
        running, waiting, preemptions, queries, hits = values
        self.last_stats = SchedulerStats(num_requests_running=running, num_requests_waiting=waiting,
                                         num_preemptions_total=preemptions, prefix_cache_queries=queries + hits,
                                         prefix_cache_hits=hits)
        self.reporter = reporter
        self.observer.on_scheduler_stats(self.last_stats, reporter)

    def close(self, owns_core: bool) -> None:
        """The engine closed for good (`on_closed`): the last action of a script."""
        self.observer.stats.owns_core, self.owns, self.closed = owns_core, owns_core, True
        self.observer.on_closed()

    def play(self, actions: list[tuple]) -> None:
        for action in actions:
            kind, *args = action
            if kind == "tick":
                self.now += args[0]
            else:
                getattr(self, kind)(*args)


# ------------------------------------------------------------------ comparisons
def _le_counts(values: list[float], bounds: tuple[float, ...]) -> list[int]:
    """Cumulative Prometheus `le` counts, +Inf last."""
    return [sum(1 for v in values if v <= bound) for bound in bounds] + [len(values)]


def _check_host_stats(player: Player) -> None:
    stats, model = player.observer.stats, player.model
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (model.prompt_total, model.gen_total)
    assert {r: c for r, c in stats.request_success.items() if c or r in REASONS} == model.success
    for name, (_, bounds) in HISTOGRAMS.items():
        histogram, values = getattr(stats, name), model.seen[name]
        assert histogram.bounds == bounds, name
        cumulative, running = [], 0
        for count in histogram.counts:
            running += count
            cumulative.append(running)
        assert (name, cumulative) == (name, _le_counts(values, bounds))
        assert histogram.sum == pytest.approx(sum(values), rel=1e-9, abs=1e-9), name


def _check_snapshot(player: Player) -> None:
    snap, model, last = player.observer.stats.snapshot(), player.model, player.last_stats or SchedulerStats()
    assert (snap.prompt_tokens_total, snap.generation_tokens_total) == (model.prompt_total, model.gen_total)
    assert snap.request_success_total == model.success
    running = (0, 0) if player.closed else (last.num_requests_running, last.num_requests_waiting)  # nothing runs
    assert (snap.num_requests_running, snap.num_requests_waiting) == running
    assert snap.num_preemptions_total == last.num_preemptions_total
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (last.prefix_cache_queries, last.prefix_cache_hits)


def _scrape(player: Player) -> dict[tuple[str, tuple], float]:
    text = generate_latest(player.observer.registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert (labels.pop("model_name", "m"), labels.pop("engine", "0")) == ("m", "0")
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


def _check_prometheus(player: Player) -> None:
    got, model, p = _scrape(player), player.model, "asyncllm:"
    assert got[(p + "prompt_tokens_total", ())] == model.prompt_total
    assert got[(p + "generation_tokens_total", ())] == model.gen_total
    for reason, count in model.success.items():
        assert got[(p + "request_success_total", (("finished_reason", reason),))] == count
    for name, (exported, bounds) in HISTOGRAMS.items():
        values = model.seen[name]
        assert got[(p + exported + "_count", ())] == len(values), name
        assert got[(p + exported + "_sum", ())] == pytest.approx(sum(values), rel=1e-9, abs=1e-9), name
        buckets = sorted((float(dict(labels)["le"]), value) for (sample, labels), value in got.items()
                         if sample == p + exported + "_bucket")
        assert buckets == list(zip([*bounds, float("inf")], _le_counts(values, bounds))), name
    last, key = player.last_stats or SchedulerStats(), (lambda name: (p + name, ()))
    reported = player.last_stats is not None and player.reporter  # the engine-wide series: one host reports them
    gauges = {key("num_requests_running"): last.num_requests_running,
              key("num_requests_waiting"): last.num_requests_waiting}
    counters = {key("num_preemptions_total"): last.num_preemptions_total,
                key("prefix_cache_queries_total"): last.prefix_cache_queries,
                key("prefix_cache_hits_total"): last.prefix_cache_hits}
    assert {k: got[k] for k in gauges if k in got} == (gauges if reported and not player.closed else {})
    # closed for good: the gauges leave; the final counters of a core this host owned stay
    assert {k: got[k] for k in counters if k in got} == (counters if reported and (not player.closed or player.owns)
                                                         else {})


def _check_request_metrics(player: Player) -> None:
    """`RequestOutput.metrics` (docs/observability.md "Per-request timing"): an n > 1 request's queued and first
    scheduled times are its earliest sample's, its preemptions all its samples', its last token the latest."""
    for req in player.reqs:
        metrics = req.collector.metrics
        lasts = [s.last for s in req.samples if s.last is not None]
        assert (metrics.queued_time, metrics.first_scheduled_time) == (req.queued, req.sched), req.rid
        assert (metrics.num_preemptions, metrics.last_token_time) == (req.preemptions, max(lasts, default=None))


def _run(script: tuple[int, list[tuple]]) -> Player:
    max_model_len, actions = script
    player = Player(max_model_len)
    player.play(actions)
    _check_host_stats(player)
    _check_snapshot(player)
    _check_prometheus(player)
    _check_request_metrics(player)
    live = {r.rid for r in player.reqs if r.live()}  # no ended request's state stays behind
    observer = player.observer
    assert set(observer._samples) | set(observer._max_tokens) | set(observer._most_generated) <= live
    return player


# ------------------------------------------------------------------ edge cases
ONE_DELTA = (0, [("add", 1, 5, 5, False, 0.0), ("tick", 0.25), ("step", [(0, 3, "length", 3, 0.0, 1.0)])])
"""Finishes in its first delta: no inter-token latency; ttft 0.25 s and decode 0 on bucket bounds."""
ZERO_LENGTH = (20, [("add", 2, 5, None, False, 0.5), ("tick", 0.5), ("step", [(0, 0, "stop", 3, 0.5, 0.5)]),
                    ("step", [(0, 1, None, 0, 0.0, 0.0)]), ("tick", 1.0), ("step", [(0, 1, "length", 0, 0.0, 0.0)])])
"""An n = 2 request whose sample 0 finishes without a token; unset max_tokens observes max_model_len - prompt."""
ABORT_QUEUED = (8, [("add", 3, 2, 2, False, 0.0), ("tick", 0.5), ("abort", 0), ("add", 1, 10, None, False, 0.25),
                    ("tick", 0.5), ("step", [(0, 2, "stop", 2, 0.5, 0.5)]), ("stats", [1, 2, 3, 4, 5], True),
                    ("close", True)])
"""Three samples aborted while queued (three aborts, nothing observed) beside one that finished; then the engine,
which owned its core, closes: its gauges leave, its counters stay."""
SAME_STEP_TIME = (0, [("add", 2, 1, 1, False, 0.0), ("tick", 0.125), ("step", [(0, 1, None, 3, 1.0, 0.0)]),
                      ("step", [(1, 1, None, 0, 0.0, 0.0), (0, 2, None, 1, 0.0, 0.0)]),
                      ("tick", 1.0), ("step", [(0, 1, "stop", 0, 0, 0), (0, 1, "timeout", 0, 0, 0)]),
                      ("add", 1, 3, None, True, 0.5), ("step", [(0, 0, None, 2, 0.25, 0.5)]),
                      ("add", 2, 2, None, False, 0.0), ("step", [(0, 1, None, 0, 0, 0)]), ("fail", 0),
                      ("stats", [0, 0, 0, 0, 0], False)])
"""Two deltas of one sample at one time (no inter-token latency), a preemption, a pooling request, an engine death."""
CORE_ERROR = (64, [("add", 2, 3, 7, False, 0.0), ("tick", 0.3), ("step", [(0, 2, None, 2, 0.25, 0.25)]),
                   ("tick", 0.1), ("step", [(1, 0, "error", 0, 0.0, 0.0)]), ("add", 1, 20, 20, False, 0.0),
                   ("step", [(0, 1, "abort", 0, 0.0, 0.0)]), ("stats", [2, 0, 1, 3, 1], True), ("close", False)])
"""A core error ends both samples uncounted; a core "abort" finish counts but is not observed; the engine, attached
to a core it did not launch, closes: its engine-wide series leave with it."""

N1_SAME_TIME = (20, [("add", 1, 2, 3, False, 0.0), ("add", 1, 20, None, False, 0.0),
                     ("step", [(0, 1, None, 0, 0, 0), (0, 1, "stop", 0, 0, 0)], 0.5),
                     ("step", [(0, 1, None, 0, 0, 0)], 0.0), ("step", [(0, 1, "length", 0, 0, 0)], 0.5)])
"""n = 1: two token deltas at one time (one inter-token latency for both); an unset max_tokens that leaves no room
(max_model_len - prompt = 0) is not observed."""


@settings(max_examples=EXAMPLES, deadline=None, phases=PHASES, suppress_health_check=[HealthCheck.too_slow])
@example(ONE_DELTA)
@example(ZERO_LENGTH)
@example(ABORT_QUEUED)
@example(SAME_STEP_TIME)
@example(CORE_ERROR)
@example(N1_SAME_TIME)
@given(SCRIPTS)
def test_observer_counters_and_histograms_match_the_model(script: tuple[int, list[tuple]]) -> None:
    _run(script)


def test_the_edge_examples_reach_what_they_claim() -> None:
    """The `@example`s are not vacuous: each reaches the situation it names."""
    one = _run(ONE_DELTA).model.seen
    assert one["inter_token_latency"] == [] and one["time_to_first_token"] == [0.25]
    assert one["request_decode_time"] == [0.0] and one["request_time_per_output_token"] == [0.0]
    zero = _run(ZERO_LENGTH).model.seen
    assert sorted(zero["request_generation_tokens"]) == [0, 2] and zero["request_params_max_tokens"] == [15, 15]
    aborted = _run(ABORT_QUEUED)
    assert aborted.model.success["abort"] == 3 and aborted.model.seen["request_params_n"] == [1]
    scraped = _scrape(aborted)
    assert scraped[("asyncllm:num_preemptions_total", ())] == 3 and ("asyncllm:num_requests_running", ()) not in scraped
    same = _run(SAME_STEP_TIME).model.seen
    assert same["inter_token_latency"] == [1.0, 1.0] and same["iteration_tokens"] == [2, 4, 2, 3, 3]
    assert same["request_params_n"] == [2, 1] and same["request_queue_time"] == [0.0, 0.1875]
    error_player = _run(CORE_ERROR)
    error = error_player.model
    assert error.success == {"stop": 0, "length": 0, "abort": 1, "timeout": 0}
    assert error.seen["e2e_request_latency"] == [] and error.gen_total == 3
    assert error.seen["iteration_tokens"] == [5, 0, 21]
    n1 = _run(N1_SAME_TIME).model.seen
    assert (n1["inter_token_latency"], n1["request_params_max_tokens"]) == ([0.5], [3])
    assert (n1["request_decode_time"], n1["request_time_per_output_token"]) == ([0.0, 0.5], [0.0, 0.25])
    engine_series = {"asyncllm:num_preemptions_total", "asyncllm:num_requests_running"}
    assert not engine_series & {name for name, _ in _scrape(error_player)}
