"""Prometheus multiprocess mode: the ``asyncllm:`` series of several host processes, scraped as one.

With ``PROMETHEUS_MULTIPROC_DIR`` set in a host process (vLLM's setup, e.g.
``uvicorn --workers N`` around one shared engine core), a scrape reaches one
worker, so each worker writes its series into per-process files in that folder
(`asyncllm.metrics.multiprocess_files`: its own, apart from prometheus_client's)
and ``/metrics`` serves a `MultiProcessCollector` over them
(`multiprocess_latest`), which adds the processes up:

- request counters and histograms: each process's own totals, summed (what
  they grew by: an engine garbage-collected takes nothing back);
- engine-wide counters (preemptions, prefix cache, spec decode): the core's
  counts, exported by its reporter host only. Each process writes what the
  counter grew by while it reported: all of it for a core the host owns or
  for a shared core's first reporter, from its first snapshot on for a host
  that took over a shared core from one that left (no double count; what the
  core counted between the two is lost);
- gauges: ``livemostrecent``, written by the reporter host only; a gauge the
  process no longer exports (an engine closed, a LoRA adapter set no longer
  running) leaves its file.

A ``model_name`` is written once the host knows its model (`HostStats.named`:
at construction for an engine that owns its core, when the core names it for
an attached one), never the address an attached host is labelled with until
then. A named host renamed (`AsyncEngine.set_served_model_name`) moves its
series to the new name (`relabel`).

A daemon thread writes every `SYNC_INTERVAL_S` seconds; a scrape writes the
scraping process first, an engine closing writes its last counts and drops its
gauges (`AsyncEngine.aclose`, once for all its replicas, in a worker thread),
and an interpreter's exit through sys.exit writes once more and removes its
gauge file, its thread stopped first (`_Writer.closed`: no write after it; a
uvicorn worker stopped by SIGTERM dies by the signal, one killed by SIGKILL at
once: no atexit hook; the other processes' threads remove their gauge files,
`reap_dead`). A forked child
(gunicorn ``--preload``) starts over with its own pid: nothing of the parent's
growth, the inherited counts as its baseline, its thread started at its first
snapshot, sync or mirror (`_before_fork` / `_after_fork_in_child`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.mmap_dict import mmap_key

from asyncllm.errors import ConfigError
from asyncllm.metrics.multiprocess_files import LIVE_GAUGES, Entries, ProcessFiles, reap_dead, reported_elsewhere

__all__ = ["multiprocess_dir", "checked_dir", "mirror", "multiprocess_latest", "relabel", "resume", "sync",
           "SYNC_INTERVAL_S"]

logger = logging.getLogger("asyncllm.engine")

SYNC_INTERVAL_S = 1.0

_Key = tuple[str, str, str, tuple[tuple[str, str], ...], str]
"""(type, family name, sample name, labels, documentation)."""


def multiprocess_dir() -> str | None:
    """The folder of prometheus_client's multiprocess mode, or None when the host runs in one-process mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def checked_dir() -> str:
    """`multiprocess_dir`, which must be set: a `ConfigError` naming PROMETHEUS_MULTIPROC_DIR unless it is a
    writable folder (else each write, scrape and exit would fail)."""
    folder = multiprocess_dir()
    if folder is None or not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError("PROMETHEUS_MULTIPROC_DIR", folder, "prometheus_client's multiprocess mode writes each "
                          "host process's series into that folder: make it an existing writable directory, or "
                          "unset the variable")
    return folder


class _Writer:
    """This process's values in the folder: per counter (and histogram sample) what it grew by in each collector."""

    def __init__(self, pid: int | None = None) -> None:
        """`pid`: the one its files are named after (a test's stand-in for another process; None: this one's)."""
        self.collectors: weakref.WeakSet[Any] = weakref.WeakSet()
        """Added and read under `lock` (a WeakSet changed while iterated raises)."""
        self.folder = checked_dir()
        from asyncllm.metrics.prometheus import ENGINE_COUNTER_NAMES, process_families  # which imports this module

        self._engine_counters = ENGINE_COUNTER_NAMES
        self._process_families = process_families
        self.thread_pid: int | None = None
        """The process in which the writer thread runs (None: not started, or stopped by `_at_exit`)."""
        self.closed = False
        """The process exits (`_at_exit`, set under `lock`): no write after its last one, no thread started."""
        self.fork_baseline: dict[Any, dict[_Key, float]] | None = None
        """Each collector's samples as the process forks: the child's `_last_seen`."""
        self._active: set[str] = set()
        """The model names a host knows (`HostStats.named`): written from then on, at 0 too."""
        self.start_over({}, pid)

    def start_over(self, last_seen: dict[Any, dict[_Key, float]], pid: int | None = None) -> None:
        """No values written yet, in this pid's files; `last_seen`: the counts already written by another pid."""
        self.lock = threading.Lock()
        self.pid = os.getpid()
        """The process whose files these are."""
        self.files = ProcessFiles(self.folder, pid or self.pid)
        self._last_seen: weakref.WeakKeyDictionary[Any, dict[_Key, float]] = weakref.WeakKeyDictionary(last_seen)
        """Per collector, each counter's value at the last sync (while it exports it)."""
        self._grown: dict[_Key, float] = defaultdict(float)
        """What this process writes for each counter: a collector that went away takes nothing back."""
        self._elsewhere: dict[_Key, bool] = {}
        """Whether a counter file held a shared core's engine-wide counter when this process first saw it."""

    def sync(self, final: bool = False) -> None:
        """Write every collector's series, unless `closed` (but for `_at_exit`'s `final` write). The first report
        of a shared core's engine-wide counter reads the folder's counter files (`_taken_over`) outside the lock,
        then syncs again: an engine attaching or a scrape never waits on that."""
        found: dict[_Key, bool] = {}
        while True:
            with self.lock:
                if self.closed and not final:
                    return  # the process exits: its gauge file is removed, not written again
                self._elsewhere.update(found)
                collectors = list(self.collectors)
                families, gauges = self._process_families(collectors)  # each engine's view read once
                per_collector = [(collector, _totals(own), collector.owned_core_models())
                                 for collector, own in zip(collectors, families, strict=True)]
                for collector, _, _ in per_collector:
                    self._active.update(collector.named_models())
                unchecked = self._unchecked(per_collector)
                if not unchecked:
                    self._write(per_collector, self._gauges(gauges))
                    return
            in_files = reported_elsewhere(self.folder, map(_file_key, unchecked))
            found = {key: _file_key(key) in in_files for key in unchecked}

    def _gauges(self, families: list[Metric]) -> dict[_Key, float]:
        """The process's gauges of named models, its collectors' engines combined each by its own rule (KV usage
        as blocks, `lora_requests_info` the time: `prometheus.process_families`), as one registry would."""
        gauges = _totals(families)
        return {key: value for key, value in gauges.items() if _model(key) in self._active}

    def _write(self, per_collector: list[tuple[Any, dict[_Key, float], set[str]]], gauges: dict[_Key, float]) -> None:
        for collector, samples, owned in per_collector:
            self._add_growth(self._last_seen.setdefault(collector, {}), samples, owned)
        now = time.time()
        entries: dict[str, Entries] = {"counter": {}, "histogram": {}, LIVE_GAUGES: {}}
        for key, value in gauges.items():  # a gauge no longer exported leaves the file
            entries[LIVE_GAUGES][_file_key(key)] = (value, now)
        for key, value in self._grown.items():
            entries[key[0]][_file_key(key)] = (value, 0.0)
        for kind, written in entries.items():
            self.files.write(kind, written)

    def _add_growth(self, last_seen: dict[_Key, float], samples: dict[_Key, float], owned: set[str]) -> None:
        for key in [k for k in last_seen if k not in samples]:
            del last_seen[key]  # this host no longer reports the core: a later report counts from its first value
        for key, value in samples.items():
            if _model(key) not in self._active or key[0] == "gauge":
                continue  # not named yet (perhaps the core's address: no way to remove a series later); `_gauges`
            last = last_seen.get(key)
            if last is None and not self._taken_over(key, owned):
                last = 0.0  # this process's own series, its own core, or a shared core's first reporter: all of it
            if last is not None:
                self._grown[key] += max(0.0, value - last)
            last_seen[key] = value

    def _shared_engine_counter(self, key: _Key, owned: set[str]) -> bool:
        """An engine-wide counter of a shared core (not one this collector's hosts own)."""
        return key[0] == "counter" and key[1] in self._engine_counters and _model(key) not in owned

    def _taken_over(self, key: _Key, owned: set[str]) -> bool:
        """Whether a new report of `key` continues another host's: a shared core's engine-wide counter that this
        process or another already wrote."""
        return self._shared_engine_counter(key, owned) and (key in self._grown or self._elsewhere[key])

    def _unchecked(self, per_collector: list[tuple[Any, dict[_Key, float], set[str]]]) -> set[_Key]:
        """The keys `_taken_over` would look up in the folder's files, not looked up yet."""
        return {key for collector, samples, owned in per_collector for key in samples
                if _model(key) in self._active and key not in self._grown and key not in self._elsewhere
                and key not in self._last_seen.get(collector, {}) and self._shared_engine_counter(key, owned)}

    def relabel(self, old: str, new: str, apply: Callable[[], None]) -> None:
        """`apply()` renames a named host's model from `old` to `new`: what its counters counted so far is not
        new growth, and a series of `old` that no host exports any more moves to `new` (its keys leave the file)."""
        with self.lock:
            collectors = list(self.collectors)
            before = [_samples(collector) for collector in collectors]
            apply()
            after = [_samples(collector) for collector in collectors]
            for collector, was, now in zip(collectors, before, after, strict=True):
                last_seen = self._last_seen.setdefault(collector, {})
                for key, value in now.items():
                    if key[0] != "gauge" and (moved := value - was.get(key, 0.0)):
                        last_seen[key] = last_seen.get(key, 0.0) + moved
            exported = set().union(*after)
            for key in [k for k in self._grown if _model(k) == old and k not in exported]:
                self._grown[_relabelled(key, new)] += self._grown.pop(key)


def _relabelled(key: _Key, model_name: str) -> _Key:
    typ, family, name, labels, documentation = key
    return typ, family, name, tuple((k, model_name if k == "model_name" else v) for k, v in labels), documentation


@functools.lru_cache(maxsize=4096)
def _file_key(key: _Key) -> str:
    _, family, name, labels, documentation = key
    return mmap_key(family, name, [k for k, _ in labels], [v for _, v in labels], documentation)


def _model(key: _Key) -> str | None:
    return dict(key[3]).get("model_name")


def _samples(collector: Any) -> dict[_Key, float]:
    """The collector's samples (`_totals`)."""
    return _totals(collector.collect())


def _totals(families: Iterable[Metric]) -> dict[_Key, float]:
    """The families' samples; histogram buckets per bucket (not cumulative), as prometheus_client's files hold
    them, and no ``_count`` (the scrape derives it)."""
    totals: dict[_Key, float] = defaultdict(float)
    for family in families:
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
_STALE_FILE = re.compile(r"_(\d+)\.db$")


def mirror(collector: Any) -> None:
    """Write `collector`'s series into the multiprocess folder from now on (until it is garbage-collected);
    a `ConfigError` unless the folder is a writable directory."""
    global _writer
    folder = checked_dir()
    with _writer_lock:
        if _writer is None:
            _warn_if_stale(folder)
            _writer = _Writer()
            atexit.register(_at_exit, _writer)
        with _writer.lock:
            _writer.collectors.add(collector)
        _start_thread(_writer)


def resume() -> None:
    """Start this process's writer thread if it has none: a forked child's first snapshot (`RequestObserver`)."""
    writer = _writer
    if writer is not None and writer.thread_pid != os.getpid():
        with _writer_lock:
            _start_thread(writer)


def _start_thread(writer: _Writer) -> None:
    if writer.thread_pid != os.getpid() and not writer.closed:
        writer.thread_pid = os.getpid()
        threading.Thread(target=_sync_forever, args=(writer,), name="asyncllm-prometheus-multiproc",
                         daemon=True).start()


def _warn_if_stale(folder: str) -> None:
    """vLLM's warning, for files of processes no longer running (the live workers' files are expected)."""
    stale = sorted(name for name in os.listdir(folder)
                   if (match := _STALE_FILE.search(name)) is not None and not pid_running(int(match.group(1))))
    if stale:
        logger.warning("asyncllm: PROMETHEUS_MULTIPROC_DIR=%s holds the files of processes no longer running "
                       "(%s): their counts are added into every scrape; empty the folder before the host "
                       "processes start", folder, ", ".join(stale[:5]) + (", ..." if len(stale) > 5 else ""))


def pid_running(pid: int) -> bool:
    """Whether process `pid` runs (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sync() -> None:
    """Write this process's series now (a scrape does, so its own process is current; an engine closing does).
    A failed write is logged, not raised: the scrapes show the last values written."""
    if _writer is not None:
        resume()
        try:
            _writer.sync()
        except OSError:
            logger.exception("asyncllm: could not write the Prometheus series to PROMETHEUS_MULTIPROC_DIR=%s",
                             multiprocess_dir())


def _sync_forever(writer: _Writer) -> None:
    logged = False
    while writer.thread_pid == os.getpid():
        time.sleep(SYNC_INTERVAL_S)
        try:
            reap_dead(writer.folder, pid_running)
            writer.sync()
        except Exception:  # noqa: BLE001 - the folder went away or filled up, or a bug: the thread carries on
            if not logged:
                logged = True
                logger.exception("asyncllm: could not write the Prometheus series to PROMETHEUS_MULTIPROC_DIR=%s "
                                 "(logged once; retried every %s s)", multiprocess_dir(), SYNC_INTERVAL_S)


def _at_exit(writer: _Writer) -> None:
    if os.getpid() != writer.pid:  # a child forked without the fork hooks: these are its parent's files
        return
    with writer.lock:  # the thread runs on during atexit: once this is set it writes nothing more
        writer.closed, writer.thread_pid = True, None
    writer.sync(final=True)
    writer.files.remove_live()


def relabel(old: str, new: str, apply: Callable[[], None]) -> None:
    """`apply()` renames a named host's model from `old` to `new` (`_Writer.relabel`), atomically for the writer."""
    if _writer is None:
        apply()
    else:
        _writer.relabel(old, new, apply)


def _before_fork() -> None:
    """Hold the locks over the fork (a child never inherits one held by another thread) and take the baseline."""
    _writer_lock.acquire()
    if _writer is not None:
        _writer.lock.acquire()
        try:
            _writer.fork_baseline = {collector: _samples(collector) for collector in list(_writer.collectors)}
        except Exception:  # noqa: BLE001 - a fork must not fail for metrics: the child counts from 0
            _writer.fork_baseline = None


def _after_fork_in_parent() -> None:
    if _writer is not None:
        _writer.fork_baseline = None
        _writer.lock.release()
    _writer_lock.release()


def _after_fork_in_child() -> None:
    """The child's own files, from the inherited counts on; its thread starts with its first write (`resume`)."""
    global _writer_lock
    _writer_lock = threading.Lock()
    if _writer is not None:
        _writer.start_over(_writer.fork_baseline or {})
        _writer.fork_baseline = None


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def multiprocess_latest() -> bytes:
    """The Prometheus text of every host process's series in the folder, summed (the ``/metrics`` body)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    sync()
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry)
