"""Host-side counters and histograms: one source for `stats()`, Prometheus and the log line.

The processor thread is the only writer, so updates take no lock: a histogram
observation is a bisect and two additions. Readers (the event loop's `stats()`,
a Prometheus scrape thread, the stats logger) may see a histogram's count one
observation ahead of its sum for the length of a batch; Prometheus tolerates that.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import zip_longest
from typing import Any, NamedTuple

from asyncllm.outputs import EngineStats
from asyncllm.protocol import SchedulerStats

__all__ = ["EngineView", "Histogram", "HostStats", "CACHE_CONFIG_LABELS", "FINISH_REASONS", "cache_config_labels",
           "engine_counters", "summed_snapshots", "NO_COUNTERS"]

# vLLM's buckets, with finer ones at the low end of the inter-token latency (fast GPUs decode in < 10 ms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
"""vLLM's ``request_time_per_output_token_seconds`` buckets."""
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
"""1, 2, 5, 10, 20, 50, ... 5,000,000 tokens."""
ITERATION_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
"""vLLM's ``iteration_tokens_total`` buckets."""
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
"""vLLM's ``request_params_n`` buckets."""

FINISH_REASONS = ("stop", "length", "abort", "timeout")
"""Always exported (at 0 until seen), so rate() works from the first request on."""


class Histogram:
    """Bucket counts and a sum, Prometheus-style (`le` buckets, +Inf last)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        """Per-bucket (not cumulative) counts; the last one is +Inf."""
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add(self, other: Histogram) -> None:
        """Add `other`'s observations (same bounds)."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum += other.sum


class EngineView(NamedTuple):
    """A host's view of its core, swapped whole (`HostStats.engine`)."""

    scheduler: SchedulerStats
    reports_engine: bool
    retired_engine: SchedulerStats
    closed: bool = False
    """Set by `HostStats.mark_closed` until the next core's snapshot: `scheduler` then holds final counters."""
    cache_config: tuple[tuple[str, str], ...] = ()
    """The core's cache settings as vLLM's ``cache_config_info`` labels (`cache_config_labels`) but num_gpu_blocks
    (its snapshot's): set before the core's first snapshot (`HostStats.set_cache_config`), dropped as it closes."""


class HostStats:
    """What this `AsyncEngine` knows: the core's latest `SchedulerStats` and its own requests.

    `reports_engine` is True on the one host the engine core picked to export the
    engine-wide series (the earliest host still attached: the one that launched an
    owned core), so hosts sharing one core report them once.
    """

    def __init__(self, model_name: str, named: bool = True) -> None:
        self.model_name = model_name
        self.engine_index: int | None = None
        """The data-parallel replica whose core this host follows (data_parallel_size > 1; its engine-wide series
        carry the label engine="<index>"), else None (no engine label)."""
        self.owns_core = False
        """Whether this host launched its core (not `AsyncEngine.connect`): the core's counters end with it."""
        self.named = named
        """Whether `model_name` is the model (an attached host: the core's address until the core names it)."""
        self.engine = EngineView(SchedulerStats(), False, SchedulerStats())
        """`scheduler`, `reports_engine` and `retired_engine` in one object, replaced whole: a scrape thread reads
        it once and never sees a core's counters both live and retired, or in neither."""
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.mm_cache_queries = 0
        """Images this host looked up in its multimodal processor-cache mirror (asyncllm/mm/cache.py)."""
        self.mm_cache_hits = 0
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.inter_token_latency = Histogram(ITL_BUCKETS)
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_time_per_output_token = Histogram(TPOT_BUCKETS)
        self.request_prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = Histogram(TOKEN_BUCKETS)
        """Per request (once, as its last sample finishes): the most tokens one of its samples generated."""
        self.request_params_n = Histogram(N_BUCKETS)
        self.request_params_max_tokens = Histogram(TOKEN_BUCKETS)
        """Per finished sample whose request set max_tokens."""
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        """Per core output batch (one engine step) with outputs for this host: the prompt tokens of the samples
        whose first token it brought plus the tokens it generated (vLLM's ``iteration_tokens_total``)."""

    @property
    def scheduler(self) -> SchedulerStats:
        """The core's latest snapshot (gauges and engine-wide counters)."""
        return self.engine.scheduler

    @scheduler.setter
    def scheduler(self, value: SchedulerStats) -> None:
        self.take_snapshot(value, self.reports_engine)

    def take_snapshot(self, scheduler: SchedulerStats, reports_engine: bool) -> None:
        """A core's snapshot, and whether this host exports the engine-wide series, in one swap: the core is live
        (no longer `closed`)."""
        self.engine = self.engine._replace(scheduler=scheduler, reports_engine=reports_engine, closed=False)

    @property
    def reports_engine(self) -> bool:
        return self.engine.reports_engine

    @reports_engine.setter
    def reports_engine(self, value: bool) -> None:
        self.engine = self.engine._replace(reports_engine=value)

    @property
    def retired_engine(self) -> SchedulerStats:
        """The final engine-wide counters of this host's own cores that stopped or died, summed (a restarted core
        counts from 0): Prometheus adds them to the live core's, so the summed counters never go down."""
        return self.engine.retired_engine

    @retired_engine.setter
    def retired_engine(self, value: SchedulerStats) -> None:
        self.engine = self.engine._replace(retired_engine=value)

    def set_cache_config(self, cache_config: Any) -> None:
        """The core's `CacheConfig`, for ``cache_config_info``: set before its processor starts (no snapshot swaps
        the view meanwhile), again after a restart."""
        self.engine = self.engine._replace(cache_config=cache_config_labels(cache_config))

    def core_ready(self, num_gpu_blocks: int) -> None:
        """A core's `Ready` (a start, or a core restart): until its first snapshot, stats() names its KV cache's size,
        not 0 nor a dead core's (a restarted core may size its cache anew). A snapshot of it taken already wins."""
        view = self.engine
        if view.closed or view.scheduler.num_gpu_blocks == 0:  # no snapshot of this core yet
            view.scheduler.num_gpu_blocks = num_gpu_blocks  # in place: the admission's `Delivered` holds this object

    def count_finished(self, finish_reason: str) -> None:
        self.request_success[finish_reason] = self.request_success.get(finish_reason, 0) + 1

    def mark_closed(self) -> None:
        """The engine is gone for this host: nothing runs or waits any more, no block is in use.

        It stops exporting the engine-wide series: another host attached to the
        same core (if any) exports them now, and counting its counters twice
        would be wrong. The counters of a core this host owns are final: they
        go to `retired_engine`.
        """
        s = self.scheduler
        scheduler = SchedulerStats(
            num_gpu_blocks=s.num_gpu_blocks, num_preemptions_total=s.num_preemptions_total,
            num_swapped_total=s.num_swapped_total, weights_version=s.weights_version, prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_requests=s.prefix_cache_requests, cpu_prefix_cache_hits=s.cpu_prefix_cache_hits,
            preempted_prefix_cache_hits=s.preempted_prefix_cache_hits,
            prompt_tokens_total=s.prompt_tokens_total, generation_tokens_total=s.generation_tokens_total,
            num_steps_total=s.num_steps_total, mm_encoder_cache_queries=s.mm_encoder_cache_queries,
            mm_encoder_cache_hits=s.mm_encoder_cache_hits, spec_decode_num_drafts=s.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=s.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec_decode_num_accepted_tokens,
            spec_decode_accepted_per_pos=s.spec_decode_accepted_per_pos,
        )
        retired = self.retired_engine
        if self.reports_engine and self.owns_core:
            retired = summed_snapshots([retired, scheduler])
        self.engine = EngineView(scheduler, False, retired, True)  # one swap: no scrape sees a half-closed engine

    def absorb(self, other: HostStats) -> None:
        """Add the final counters and histograms of `other`, an engine closed for good (after its `mark_closed`)."""
        self.prompt_tokens_total += other.prompt_tokens_total
        self.generation_tokens_total += other.generation_tokens_total
        self.mm_cache_queries += other.mm_cache_queries
        self.mm_cache_hits += other.mm_cache_hits
        for reason, count in list(other.request_success.items()):
            self.request_success[reason] = self.request_success.get(reason, 0) + count
        for name, histogram in vars(other).items():
            if isinstance(histogram, Histogram):
                getattr(self, name).add(histogram)
        self.retired_engine = summed_snapshots([self.retired_engine, other.retired_engine])

    def snapshot(self, engine_alive: bool = True) -> EngineStats:
        """A typed copy of every gauge and counter (no I/O; a few microseconds). The engine-wide counters are
        Prometheus' (`engine_counters`): a restarted core's count on from the dead one's."""
        view = self.engine
        s, c = view.scheduler, engine_counters(view)
        return EngineStats(
            num_requests_running=s.num_requests_running, num_requests_waiting=s.num_requests_waiting,
            kv_cache_usage=s.kv_cache_usage, num_gpu_blocks=s.num_gpu_blocks, num_used_blocks=s.num_used_blocks,
            num_preemptions_total=c.num_preemptions_total, prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_requests=c.prefix_cache_requests, prefix_cache_hits=c.prefix_cache_hits,
            cpu_prefix_cache_hits=c.cpu_prefix_cache_hits,
            preempted_prefix_cache_hits=c.preempted_prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total, engine_alive=engine_alive,
            num_steps_total=c.num_steps_total,
            request_success_total=dict(self.request_success), num_swapped_total=c.num_swapped_total,
            mm_cache_queries=self.mm_cache_queries, mm_cache_hits=self.mm_cache_hits,
            mm_encoder_cache_queries=c.mm_encoder_cache_queries, mm_encoder_cache_hits=c.mm_encoder_cache_hits,
            spec_decode_num_drafts=c.spec_decode_num_drafts, spec_decode_num_draft_tokens=c.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=c.spec_decode_num_accepted_tokens,
            spec_decode_accepted_per_pos=list(c.spec_decode_accepted_per_pos),
            weights_version=s.weights_version, is_sleeping=s.sleep_level > 0, sleep_level=s.sleep_level,
            awaiting_weights=s.awaiting_weights,
        )


def cache_config_labels(cache_config: Any) -> tuple[tuple[str, str], ...]:
    """vLLM's ``CacheConfig.metrics_info()`` for the settings asyncllm has, under vLLM's names (``cache_dtype`` is
    asyncllm's kv_cache_dtype), each value as ``str()`` makes it ("True", "None", "0.9"), as vLLM's."""
    return tuple((label, str(getattr(cache_config, field))) for label, field in _CACHE_CONFIG_FIELDS)


_CACHE_CONFIG_FIELDS = (
    ("block_size", "block_size"), ("gpu_memory_utilization", "gpu_memory_utilization"),
    ("swap_space", "swap_space"), ("cache_dtype", "kv_cache_dtype"),
    ("num_gpu_blocks_override", "num_gpu_blocks_override"), ("enable_prefix_caching", "enable_prefix_caching"),
    ("prefix_caching_hash_algo", "prefix_caching_hash_algo"), ("kv_cache_memory_bytes", "kv_cache_memory_bytes"),
    ("kv_offloading_size", "kv_offloading_size"), ("mamba_block_size", "mamba_block_size"),
)
"""(vLLM's label, asyncllm's `CacheConfig` field)."""
CACHE_CONFIG_LABELS = (*(label for label, _ in _CACHE_CONFIG_FIELDS), "num_gpu_blocks")


NO_COUNTERS = SchedulerStats()
"""No counters at all: a `retired_engine` of a host whose cores never stopped."""


def engine_counters(view: EngineView) -> SchedulerStats:
    """A host's engine-wide counters: its live core's plus the final ones of its cores that stopped or died
    (`HostStats.retired_engine`); once closed, those final ones alone (they hold the last core's)."""
    if view.retired_engine == NO_COUNTERS:
        return view.scheduler
    if view.closed:
        return view.retired_engine
    return summed_snapshots([view.scheduler, view.retired_engine])


_LARGEST = ("max_lora", "weights_version", "sleep_level")
"""Settings and states, not amounts: several engines' are their largest (never a sum)."""

_UNITED = ("running_lora_adapters", "waiting_lora_adapters")
"""Lists of names: several engines' are the sorted union."""


def summed_snapshots(snapshots: list[SchedulerStats]) -> SchedulerStats:
    """Numbers add up (KV usage then is used / total blocks of all engines), but for `_LARGEST`'s; adapter names
    are united; anything else is the first's."""
    fields = {}
    for name in SchedulerStats.__struct_fields__:
        values = [getattr(s, name) for s in snapshots]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        fields[name] = (max(values) if name in _LARGEST else sum(values)) if numeric else values[0]
    for name in _UNITED:
        fields[name] = sorted({adapter for s in snapshots for adapter in getattr(s, name)})
    fields["spec_decode_accepted_per_pos"] = [
        sum(n) for n in zip_longest(*(s.spec_decode_accepted_per_pos for s in snapshots), fillvalue=0)]
    return SchedulerStats(**fields)
