"""Prometheus series under the ``asyncllm:`` prefix, vLLM's names and meanings.

Each `CollectorRegistry` holds one `AsyncLLMCollector`, shared by every engine
that uses the registry (the host's registry passed as ``prometheus_registry=``,
or a private one per engine). At scrape time it reads the engines' `HostStats`
(held weakly: a garbage-collected engine drops out) and sums engines that
serve the same ``model_name`` (and data-parallel replica index). Summed counters never go down: an engine closed
for good (`retire`) leaves its final counters and histograms in its model's
totals, and a core that stopped or died leaves its engine-wide counters
(`HostStats.retired_engine`); only its gauges leave. Nothing is ever registered in
``prometheus_client.REGISTRY`` unless the host passes it.

Engine-wide series (the gauges, preemptions, prefix-cache counters) come from
the engine core's snapshots, which every attached host receives; the core
flags one host (the earliest still attached) as their reporter, and only that
host exports them, so hosts sharing one core report them once. Request series (tokens,
finished requests, latency and length histograms) are exported by each host
for its own requests; Prometheus sums them across processes.

Every series carries vLLM's ``engine="<index>"`` label beside ``model_name``, as
vLLM's V1 series do: ``engine="0"`` for an engine without data parallelism. With
data_parallel_size > 1 every replica's core has its own `HostStats` and each
series is exported per replica (``sum by (model_name)`` adds them up).

With ``PROMETHEUS_MULTIPROC_DIR`` set, each collector's series are also written
to prometheus_client's per-process files (`asyncllm.metrics.multiprocess`), so one
scrape sums the host processes.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from asyncllm.metrics.host_stats import (
    CACHE_CONFIG_LABELS, NO_COUNTERS, EngineView, Histogram, HostStats, summed_snapshots,
)
from asyncllm.metrics.multiprocess import mirror, multiprocess_dir
from asyncllm.protocol import SchedulerStats

__all__ = ["AsyncLLMCollector", "attach", "process_families", "PREFIX", "retire"]

PREFIX = "asyncllm:"
_LABELS = ["model_name", "engine"]
_EngineKey = tuple[str, int]
"""(model_name, data-parallel replica index: 0 without data parallelism): one series each (vLLM's labels)."""
_Views = dict[_EngineKey, list[EngineView]]
"""Per model and replica, each engine's `HostStats.engine`, read once per scrape."""

_GAUGES: list[tuple[str, str, Callable[[SchedulerStats], float]]] = [
    ("num_requests_running", "Number of requests in model execution batches.", lambda s: s.num_requests_running),
    ("num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s.num_requests_waiting),
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_cache_usage),
]
_ENGINE_COUNTERS: list[tuple[str, str, Callable[[SchedulerStats], float]]] = [
    ("num_preemptions", "Cumulative number of preemptions from the engine.", lambda s: s.num_preemptions_total),
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     lambda s: s.prefix_cache_queries),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", lambda s: s.prefix_cache_hits),
    ("cpu_prefix_cache_hits", "Of the prefix cache hits, the tokens loaded back from the CPU tier (kv_offloading_size).",
     lambda s: s.cpu_prefix_cache_hits),
    ("mm_encoder_cache_queries", "Multimodal items looked up in the workers' encoder-output cache.",
     lambda s: s.mm_encoder_cache_queries),
    ("mm_encoder_cache_hits", "Multimodal items whose encoder output was cached (the vision tower did not run).",
     lambda s: s.mm_encoder_cache_hits),
    ("spec_decode_num_drafts", "Number of spec decoding drafts.", lambda s: s.spec_decode_num_drafts),
    ("spec_decode_num_draft_tokens", "Number of draft tokens.", lambda s: s.spec_decode_num_draft_tokens),
    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", lambda s: s.spec_decode_num_accepted_tokens),
]
ENGINE_COUNTER_NAMES = frozenset(PREFIX + name for name, _, _ in _ENGINE_COUNTERS) | {
    PREFIX + "spec_decode_num_accepted_tokens_per_pos"}
"""The counters that are the core's counts, not this host's (`multiprocess` writes them as growth)."""
_REQUEST_COUNTERS: list[tuple[str, str, Callable[[HostStats], float]]] = [
    ("prompt_tokens", "Number of prefill tokens processed.", lambda h: h.prompt_tokens_total),
    ("generation_tokens", "Number of generation tokens processed.", lambda h: h.generation_tokens_total),
    ("mm_cache_queries", "Multimodal items looked up in the processor cache.", lambda h: h.mm_cache_queries),
    ("mm_cache_hits", "Multimodal items found in the processor cache.", lambda h: h.mm_cache_hits),
]
_HISTOGRAMS: list[tuple[str, str, str]] = [
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", "time_to_first_token"),
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "inter_token_latency"),
    ("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", "e2e_request_latency"),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "request_queue_time"),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     "request_prefill_time"),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "request_decode_time"),
    ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     "request_inference_time"),
    ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
     "request_time_per_output_token"),
    ("request_prompt_tokens", "Number of prefill tokens processed.", "request_prompt_tokens"),
    ("request_generation_tokens", "Number of generation tokens processed.", "request_generation_tokens"),
    ("request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
     "request_max_num_generation_tokens"),
    ("request_params_n", "Histogram of the n request parameter.", "request_params_n"),
    ("request_params_max_tokens", "Histogram of the max_tokens request parameter.", "request_params_max_tokens"),
    ("iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration_tokens"),
]


class AsyncLLMCollector(Collector):
    """Reads the `HostStats` of the engines attached to one registry at scrape time."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet[HostStats] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._retired: dict[_EngineKey, HostStats] = {}
        """Per model (and replica index), the final counters and histograms of the engines closed for good."""

    def add(self, stats: HostStats) -> None:
        with self._lock:
            self._sources.add(stats)

    def retire(self, stats: HostStats) -> None:
        """`stats`' engine closed for good: its counters stay in its model's totals, its gauges leave."""
        with self._lock:
            if stats not in self._sources:
                return
            key = (stats.model_name, stats.engine_index)
            retired = HostStats(stats.model_name, stats.named)  # new, not added to: a scrape may be reading the old one
            retired.engine_index = stats.engine_index
            for closed in (self._retired.get(key), stats):
                if closed is not None:
                    retired.absorb(closed)
            self._sources.discard(stats)  # with the swap: no scrape counts `stats` twice or not at all
            self._retired[key] = retired

    def named_models(self) -> set[str]:
        """The model names of the hosts that know their model (`HostStats.named`)."""
        with self._lock:
            return {stats.model_name for stats in [*self._sources, *self._retired.values()] if stats.named}

    def owned_core_models(self) -> set[str]:
        """The models whose engine-wide series here come only from cores these hosts own (their counts start at
        0 with the host, never taken over from another host's report)."""
        with self._lock:
            sources = list(self._sources)
        owned = {stats.model_name for stats in sources if stats.owns_core}
        return owned - {stats.model_name for stats in sources if not stats.owns_core and stats.reports_engine}

    def describe(self) -> Iterable[Metric]:
        """The families without samples, so the registry refuses a clashing name up front."""
        return _families({})

    def sources(self) -> list[HostStats]:
        """The engines' `HostStats`: the live ones, and per model the retired engines' totals."""
        with self._lock:
            return [*self._sources, *self._retired.values()]

    def collect(self) -> Iterable[Metric]:
        return _families(_by_engine(self.sources()))


def process_families(collectors: Iterable[AsyncLLMCollector]) -> tuple[list[list[Metric]], list[Metric]]:
    """One process's series in multiprocess mode, where each engine with a private registry has a collector of its
    own: each collector's families but its gauges, and the gauges of all their engines combined as one collector
    combines its engines (each by its rule: `summed_snapshots`, KV usage as blocks, `lora_requests_info` the
    time). Each engine's view is read once for both."""
    per_collector: list[list[Metric]] = []
    merged: _Views = defaultdict(list)
    for collector in collectors:
        by_engine = _by_engine(collector.sources())
        views = _views(by_engine)
        per_collector.append(list(_families(by_engine, views, gauges=False)))
        for key, group in views.items():
            merged[key].extend(group)
    return per_collector, list(_gauges(_engine_stats(merged), merged))


def _by_engine(sources: list[HostStats]) -> dict[_EngineKey, list[HostStats]]:
    """`sources` per model and replica index (None, an engine without data parallelism, is replica 0 as in vLLM)."""
    by_engine: dict[_EngineKey, list[HostStats]] = defaultdict(list)
    for stats in sources:
        by_engine[(stats.model_name, stats.engine_index or 0)].append(stats)
    return by_engine


def _views(by_engine: dict[_EngineKey, list[HostStats]]) -> _Views:
    return {key: [h.engine for h in group] for key, group in by_engine.items()}


def _gauges(engines: dict[_EngineKey, SchedulerStats], views: _Views) -> Iterator[Metric]:
    for name, doc, read in _GAUGES:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=_LABELS)
        for key, scheduler in engines.items():
            family.add_sample(PREFIX + name, _labels(key), read(scheduler))
        yield family
    yield _lora_info(engines)
    yield _cache_config_info(views)


def _cache_config_info(views: _Views) -> Metric:
    """vLLM's ``cache_config_info``: value 1, its labels the cache settings of each core reported here (vLLM's
    `CacheConfig.metrics_info()` names: `cache_config_labels`), num_gpu_blocks the core's; beside vLLM's labels,
    ``model_name`` (one registry may hold several models). Engines of one model with the same settings: one sample."""
    names = [*_LABELS, *CACHE_CONFIG_LABELS]
    family = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig", labels=names)
    seen: set[tuple[str, ...]] = set()
    for key, group in views.items():
        for view in group:
            if view.reports_engine and view.cache_config:
                labels = _labels(key, **dict(view.cache_config), num_gpu_blocks=str(view.scheduler.num_gpu_blocks))
                values = tuple(labels[name] for name in names)
                if values not in seen:
                    seen.add(values)
                    family.add_metric(list(values), 1)
    return family


def _families(by_engine: dict[_EngineKey, list[HostStats]], views: _Views | None = None,
              gauges: bool = True) -> Iterator[Metric]:
    views = _views(by_engine) if views is None else views  # each engine's view read once
    engines = _engine_stats(views)
    if gauges:
        yield from _gauges(engines, views)
    counters = _engine_counters(views, engines)
    for name, doc, read in _ENGINE_COUNTERS:
        family = CounterMetricFamily(PREFIX + name, doc, labels=_LABELS)
        for key, scheduler in counters.items():
            family.add_sample(PREFIX + name + "_total", _labels(key), read(scheduler))
        yield family
    for name, doc, read_host in _REQUEST_COUNTERS:
        family = CounterMetricFamily(PREFIX + name, doc, labels=_LABELS)
        for key, group in by_engine.items():
            family.add_sample(PREFIX + name + "_total", _labels(key), sum(read_host(h) for h in group))
        yield family
    yield _request_success(by_engine)
    yield _accepted_per_pos(counters)
    for name, doc, attribute in _HISTOGRAMS:
        family = HistogramMetricFamily(PREFIX + name, doc, labels=_LABELS)
        for key, group in by_engine.items():
            buckets, total = _merged_buckets([getattr(h, attribute) for h in group])
            family.add_metric(list(_labels(key).values()), buckets, total)
        yield family


def _engine_stats(views: _Views) -> dict[_EngineKey, SchedulerStats]:
    """Per model (and data-parallel replica), the core snapshots of the engines this process reports for, summed."""
    reported: dict[_EngineKey, list[SchedulerStats]] = defaultdict(list)
    for key, group in views.items():
        for view in group:
            if view.reports_engine:
                reported[key].append(view.scheduler)
    return {key: group[0] if len(group) == 1 else summed_snapshots(group) for key, group in reported.items()}


def _labels(key: _EngineKey, **extra: str) -> dict[str, str]:
    model, engine_index = key
    return {"model_name": model, "engine": str(engine_index), **extra}


def _engine_counters(views: _Views, engines: dict[_EngineKey, SchedulerStats]) -> dict[_EngineKey, SchedulerStats]:
    """The live cores' snapshots plus the final counters of cores that stopped (`HostStats.retired_engine`). Not
    `host_stats.engine_counters` per host: a core's live counters come once, from the host that reports it,
    and every host's retired ones are added to its key."""
    counters = dict(engines)
    for key, group in views.items():
        for view in group:
            if view.retired_engine != NO_COUNTERS:
                counters[key] = summed_snapshots([counters[key], view.retired_engine]) if key in counters \
                    else view.retired_engine
    return counters


def _lora_info(engines: dict[_EngineKey, SchedulerStats]) -> Metric:
    """vLLM's ``lora_requests_info``: one sample per engine serving adapters, its labels saying which adapters
    the running and the waiting requests use (comma-separated names) and max_loras; the value is the time (Unix
    seconds), as vLLM's ``set_to_current_time()``."""
    family = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                               labels=[*_LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    for key, scheduler in engines.items():
        if scheduler.max_lora:
            family.add_sample(family.name, _labels(key, max_lora=str(scheduler.max_lora),
                                                   running_lora_adapters=",".join(scheduler.running_lora_adapters),
                                                   waiting_lora_adapters=",".join(scheduler.waiting_lora_adapters)),
                              time.time())
    return family


def _accepted_per_pos(engines: dict[_EngineKey, SchedulerStats]) -> Metric:
    """vLLM's ``spec_decode_num_accepted_tokens_per_pos``: accepted drafts by draft position (label position)."""
    family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted tokens per draft position.", labels=[*_LABELS, "position"])
    for key, scheduler in engines.items():
        for position, count in enumerate(scheduler.spec_decode_accepted_per_pos):
            family.add_sample(family.name + "_total", _labels(key, position=str(position)), count)
    return family


def _request_success(by_engine: dict[_EngineKey, list[HostStats]]) -> Metric:
    family = CounterMetricFamily(PREFIX + "request_success", "Count of successfully processed requests.",
                                 labels=[*_LABELS, "finished_reason"])
    for key, group in by_engine.items():
        totals: dict[str, int] = defaultdict(int)
        for stats in group:
            for reason, count in list(stats.request_success.items()):
                totals[reason] += count
        for reason, count in totals.items():
            family.add_sample(family.name + "_total", _labels(key, finished_reason=reason), count)
    return family


def _merged_buckets(histograms: list[Histogram]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative `le` buckets (+Inf last) and the sum over histograms with the same bounds."""
    bounds = histograms[0].bounds
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    for histogram in histograms:
        for i, count in enumerate(list(histogram.counts)):
            counts[i] += count
        total += histogram.sum
    buckets, cumulative = [], 0
    for bound, count in zip([*map(floatToGoString, bounds), "+Inf"], counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    return buckets, total


def retire(stats: HostStats, registry: CollectorRegistry) -> None:
    """The engine of `stats` closed for good (after `HostStats.mark_closed`): its final counters stay in the summed
    series of `registry`, which never go down (Prometheus would read a drop as a reset). In multiprocess mode the
    caller writes them once all its replicas retired (`multiprocess.sync`, off the event loop)."""
    with _collectors_lock:
        collector = _collectors.get(registry)
    if collector is not None:
        collector.retire(stats)


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, AsyncLLMCollector] = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def attach(stats: HostStats, registry: Any = None) -> CollectorRegistry:
    """Export `stats` through `registry` (a new private one when None); returns the registry."""
    if registry is None:
        registry = CollectorRegistry()
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = AsyncLLMCollector()
            if multiprocess_dir() is not None:
                mirror(collector)  # first: a ConfigError for a folder that is not there registers nothing
            registry.register(collector)
            _collectors[registry] = collector
    collector.add(stats)
    return registry
