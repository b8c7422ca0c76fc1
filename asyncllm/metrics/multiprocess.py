"""Prometheus multiprocess mode: the ``asyncllm:`` series of several host processes, scraped as one.

With ``PROMETHEUS_MULTIPROC_DIR`` set in a host process (vLLM's setup, e.g.
``uvicorn --workers N`` around one shared engine core), a scrape reaches one
worker, so each worker writes its series into prometheus_client's per-process
files in that folder and ``/metrics`` serves a `MultiProcessCollector` over them
(`multiprocess_latest`), which adds the processes up:

- request counters and histograms: each process's own totals, summed (what
  they grew by: an engine garbage-collected takes nothing back);
- engine-wide counters (preemptions, prefix cache, spec decode): the core's
  counts, exported by its reporter host only. Each process writes what the
  counter grew by while it reported: all of it for the core's first reporter,
  from its first snapshot on for a host that took over from one that left (no
  double count; what the core counted between the two is lost);
- gauges: ``livemostrecent``, written by the reporter host only; a gauge the
  process no longer exports is written with timestamp 0, which that mode skips.

A file keeps every series once written, so a ``model_name`` is written from its
first counter or histogram above 0 on (not the address an attached host is
labelled with until it learns the model).

A daemon thread writes every `SYNC_INTERVAL_S` seconds; a scrape writes the
scraping process first, an engine closing (`prometheus.retire`) writes its last
counts and hides its gauges (a uvicorn or gunicorn worker exits without atexit
hooks), and an interpreter's exit writes once more and removes the live gauges'
file (`prometheus_client.multiprocess.mark_process_dead`).
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from typing import Any

from prometheus_client import values
from prometheus_client.core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key

__all__ = ["multiprocess_dir", "mirror", "multiprocess_latest", "sync", "SYNC_INTERVAL_S"]

logger = logging.getLogger("asyncllm.engine")

SYNC_INTERVAL_S = 1.0
GAUGE_MODE = "livemostrecent"

_Key = tuple[str, str, str, tuple[tuple[str, str], ...], str]
"""(type, family name, sample name, labels, documentation)."""


def multiprocess_dir() -> str | None:
    """The folder of prometheus_client's multiprocess mode, or None when the host runs in one-process mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class _Writer:
    """This process's values in the folder: per counter (and histogram sample) what it grew by in each collector."""

    def __init__(self, value_class: Any = None) -> None:
        self.collectors: weakref.WeakSet[Any] = weakref.WeakSet()
        self.lock = threading.Lock()
        if value_class is None:  # a MutexValue: the folder was set after prometheus_client was imported
            value_class = values.ValueClass if values.ValueClass is not values.MutexValue else values.MultiProcessValue()
        self._value_class = value_class
        from asyncllm.metrics.prometheus import ENGINE_COUNTER_NAMES  # which imports this module

        self._engine_counters = ENGINE_COUNTER_NAMES
        self._values: dict[_Key, Any] = {}
        self._last_seen: weakref.WeakKeyDictionary[Any, dict[_Key, float]] = weakref.WeakKeyDictionary()
        """Per collector, each counter's value at the last sync (while it exports it)."""
        self._grown: dict[_Key, float] = defaultdict(float)
        """What this process writes for each counter: a collector that went away takes nothing back."""
        self._active: set[str | None] = set()
        """The model names with a counter or histogram above 0: written from then on, at 0 too."""

    def sync(self) -> None:
        with self.lock:
            per_collector = [(collector, _samples(collector)) for collector in list(self.collectors)]
            self._active.update(_model(key) for _, samples in per_collector for key, value in samples.items()
                                if value and key[0] != "gauge")
            gauges: dict[_Key, float] = defaultdict(float)
            for collector, samples in per_collector:
                self._add_growth(self._last_seen.setdefault(collector, {}), samples, gauges)
            for key in [k for k in self._values if k[0] == "gauge" and k not in gauges]:
                self._values[key].set(0.0, 0.0)  # gone: livemostrecent skips timestamp 0
            now = time.time()
            for key, value in [*gauges.items(), *self._grown.items()]:
                self._value(key).set(value, now if key[0] == "gauge" else None)

    def _add_growth(self, last_seen: dict[_Key, float], samples: dict[_Key, float], gauges: dict[_Key, float]) -> None:
        for key in [k for k in last_seen if k not in samples]:
            del last_seen[key]  # this host no longer reports the core: a later report counts from its first value
        for key, value in samples.items():
            if _model(key) not in self._active:
                continue  # all 0: perhaps a name held only until the host attached (no way to remove it later)
            if key[0] == "gauge":
                gauges[key] += value
                continue
            last = last_seen.get(key)
            if last is None and not (key[0] == "counter" and key[1] in self._engine_counters and (key in self._grown or _reported_elsewhere(key))):
                last = 0.0  # this process's own series, or the core's first reporter: all of it
            if last is not None:
                self._grown[key] += max(0.0, value - last)
            last_seen[key] = value

    def _value(self, key: _Key) -> Any:
        value = self._values.get(key)
        if value is None:  # adds the key to this process's file
            typ, family, name, labels, documentation = key
            value = self._value_class(typ, family, name, [k for k, _ in labels], [v for _, v in labels],
                                      documentation, multiprocess_mode=GAUGE_MODE)
            self._values[key] = value
        return value


def _reported_elsewhere(key: _Key) -> bool:
    """Whether another process's file holds this counter: a host that reported the core before this one."""
    _, family, name, labels, documentation = key
    wanted = mmap_key(family, name, [k for k, _ in labels], [v for _, v in labels], documentation)
    for path in glob.glob(os.path.join(multiprocess_dir() or ".", "counter_*.db")):
        try:
            if any(found == wanted for found, *_ in MmapedDict.read_all_values_from_file(path)):
                return True
        except FileNotFoundError:
            continue
    return False


def _model(key: _Key) -> str | None:
    return dict(key[3]).get("model_name")


def _samples(collector: Any) -> dict[_Key, float]:
    """The collector's samples; histogram buckets per bucket (not cumulative), as prometheus_client's files hold
    them, and no ``_count`` (the scrape derives it)."""
    totals: dict[_Key, float] = defaultdict(float)
    for family in collector.collect():
        _add_family(totals, family)
    return totals


def _add_family(totals: dict[_Key, float], family: Metric) -> None:
    below: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
    for sample in family.samples:
        if sample.name.endswith("_count") and family.type == "histogram":
            continue
        labels = tuple(sorted(sample.labels.items()))
        value = sample.value
        if sample.name.endswith("_bucket"):
            series = tuple(item for item in labels if item[0] != "le")
            value, below[series] = value - below[series], value
        totals[(family.type, family.name, sample.name, labels, family.documentation)] += value


_writer: _Writer | None = None
_writer_lock = threading.Lock()


def mirror(collector: Any) -> None:
    """Write `collector`'s series into the multiprocess folder from now on (until it is garbage-collected)."""
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = _Writer()
            threading.Thread(target=_sync_forever, args=(_writer,), name="asyncllm-prometheus-multiproc",
                             daemon=True).start()
            atexit.register(_at_exit, _writer)
        _writer.collectors.add(collector)


def sync() -> None:
    """Write this process's series now (a scrape does, so its own process is current)."""
    if _writer is not None:
        _writer.sync()


def _sync_forever(writer: _Writer) -> None:
    logged = False
    while True:
        time.sleep(SYNC_INTERVAL_S)
        try:
            writer.sync()
        except OSError:  # the folder went away or filled up: the scrapes show the last values written
            if not logged:
                logged = True
                logger.exception("asyncllm: could not write the Prometheus series to PROMETHEUS_MULTIPROC_DIR=%s "
                                 "(logged once; retried every %s s)", multiprocess_dir(), SYNC_INTERVAL_S)


def _at_exit(writer: _Writer) -> None:
    from prometheus_client.multiprocess import mark_process_dead

    writer.sync()
    mark_process_dead(os.getpid())


def multiprocess_latest() -> bytes:
    """The Prometheus text of every host process's series in the folder, summed (the ``/metrics`` body)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    sync()
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry)
