"""The ``asyncllm:`` series' own multiprocess files (`ProcessFiles`) under drawn processes (hypothesis), scraped by
prometheus_client's `MultiProcessCollector` after every operation and compared with a naive model of the docs.

Drawn: operations on three pid slots (101-103), each holding at most one running simulated process at a time (pid
liveness is the model's: `reap_dead` is given it, no real process is started); a dead pid's slot may start a new
process (pid reuse, the folder kept). Two tests:

- `ProcessFiles` directly (`test_process_files_match_the_model`): a process adds to its counters and histograms
  (keys ``model_name`` m or n), sets or unsets gauges (``lora_requests_info`` per LoRA adapter set: a set no
  longer running leaves), renames a model (its counter and histogram keys move to the new name and leave the
  file, as `_Writer.relabel` moves them), writes its three kinds as `_Writer._write` does (counter, histogram,
  gauges; counters at timestamp 0, gauges at the operation's time), exits cleanly (`remove_live`), is killed, or
  reaps the dead (`reap_dead`).
- the writer above it (`test_writer_matches_the_model`): each process is a `_Writer` of that pid with one
  `AsyncLLMCollector` over one named `HostStats` (model m or n, reporting its core): requests finish (counters),
  TTFTs are observed (a histogram), snapshots set ``num_requests_running`` and the running LoRA adapters
  (``lora_requests_info``), the engine closes (its gauges leave), the process syncs, exits through `_at_exit`
  (a last write, its gauge file removed), is killed (no write) or reaps the dead.

The model, from the module docstrings and docs/observability.md ("Host processes behind one port"): each pid's file
of a kind holds exactly what its process's last write gave, and for counters and histograms (`CARRIED_ON`) the
values a dead process of that pid left added under it (its keys kept, never reset); the only gauge mode is
``livemostrecent`` (`LIVE_GAUGES`): a gauge is the most recently written value among the gauge files there; a
process's first gauge write replaces a dead process's gauge file, a clean exit removes its own, `reap_dead` those of
pids not running (prometheus_client's own files, ``counter_<pid>.db``, ``gauge_livesum_<pid>.db``,
``gauge_livemostrecent_<pid>.db``, never). Counters and histograms are summed over every process that ever wrote
(dead ones included); a histogram's buckets per bucket, accumulated by the scrape. For the writer, a process's share
is what its own one-process registry (`AsyncLLMCollector.collect`) showed at its last write (a series an earlier
write showed and the last did not, an engine-wide counter at 0 of an engine closed, kept: nothing is taken back).

Checked after every operation: the scrape equals the model's exactly (every sample, nothing else); each file holds
exactly the model's keys, values and gauge timestamps (a key dropped never comes back); a file the model says is gone
is not there; no staging file is left; prometheus_client's files are byte for byte as the host wrote them; the
counters' and histograms' totals never go down (pid reuse included). During every write (`ProcessFiles` test), after
each value written: a file written anew is not a ``*.db`` (no scrape reads it) and the file it replaces is as it was;
at its rename the scrape shows the old contents just before and the new ones just after (never half of a file); a file
written in place keeps every key, each at its old or its new value. The writer test also compares
`multiprocess_latest()` (the ``/metrics`` body) with the scrape at the end.

Set ``MULTIPROCESS_FILES_NO_SHRINK=1`` for a run without shrinking (mutation checks).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from asyncllm.metrics import multiprocess, multiprocess_files, prometheus
from asyncllm.metrics.host_stats import HostStats
from asyncllm.metrics.multiprocess_files import CARRIED_ON, LIVE_GAUGES, ProcessFiles, reap_dead
from asyncllm.metrics.prometheus import AsyncLLMCollector
from asyncllm.protocol import SchedulerStats

PIDS = (101, 102, 103)
MODELS = ("m", "n")
ADAPTER_SETS = ("", "a", "a,b")
KINDS = ("counter", "histogram", LIVE_GAUGES)
"""The kinds in the order `_Writer._write` writes them."""
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]
Content = dict[str, tuple[float, float]]
"""A file's keys (`mmap_key`) -> (value, timestamp)."""

settings.register_profile("multiprocess_files_mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
if os.environ.get("MULTIPROCESS_FILES_NO_SHRINK"):
    settings.load_profile("multiprocess_files_mutations")


def _key(family: str, sample: str, **labels: str) -> str:
    return mmap_key(family, sample, list(labels), list(labels.values()), f"{family} help")


def _counter_key(family: str, model: str) -> str:
    return _key(family, family + "_total", model_name=model)


def _bucket_key(model: str, le: str) -> str:
    return _key("asyncllm:h", "asyncllm:h_bucket", model_name=model, le=le)


def _gauge_key(index: int, model: str) -> str:
    """Gauge `index`: 0 a plain gauge, 1.. ``lora_requests_info`` of adapter set ``ADAPTER_SETS[index - 1]``."""
    if index == 0:
        return _key("asyncllm:g", "asyncllm:g", model_name=model)
    return _key("asyncllm:lora_requests_info", "asyncllm:lora_requests_info", model_name=model,
                running_lora_adapters=ADAPTER_SETS[index - 1])


def _renamed(key: str, old: str, new: str) -> str:
    family, sample, labels, help_text = json.loads(key)
    if labels.get("model_name") != old:
        return key
    labels = {**labels, "model_name": new}
    return mmap_key(family, sample, list(labels), list(labels.values()), help_text)


# -- the naive model of a scrape ------------------------------------------------------------------------------------


def _labels(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _le(bound: str) -> float:
    return float("inf") if bound == "+Inf" else float(bound)


def _model_scrape(files: dict[tuple[str, int], Content]) -> Scrape:
    """What the docs say a scrape shows of these files: counters summed, histogram buckets summed per bucket then
    accumulated (``_count`` the total), each gauge the value of its latest write among the files that hold it."""
    scraped: Scrape = defaultdict(float)
    buckets: dict[tuple[str, tuple], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    latest: dict[tuple, tuple[float, float]] = {}
    for (kind, _), content in files.items():
        for key, (value, timestamp) in content.items():
            family, sample, labels, _ = json.loads(key)
            if kind == LIVE_GAUGES:
                series = (sample, _labels(labels))
                if series not in latest or latest[series][1] < timestamp:
                    latest[series] = (value, timestamp)
            elif "le" in labels:
                bound = labels.pop("le")
                buckets[(family, _labels(labels))][bound] += value
            else:
                scraped[(sample, _labels(labels))] += value
    for (family, labels), per_bucket in buckets.items():
        total = 0.0
        for bound in sorted(per_bucket, key=_le):
            total += per_bucket[bound]
            scraped[(family + "_bucket", _labels({**dict(labels), "le": bound}))] = total
        scraped[(family + "_count", labels)] = total
    scraped.update({series: value for series, (value, _) in latest.items()})
    return dict(scraped)


def _scrape(folder: str) -> Scrape:
    """The folder through prometheus_client's `MultiProcessCollector`."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    return {(s.name, _labels(s.labels)): s.value for family in registry.collect() for s in family.samples}


def _read(path: str) -> Content:
    return {key: (value, timestamp) for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(path)}


def _monotone_totals(scraped: Scrape) -> dict[str, float]:
    """Per counter sample name and per histogram ``_count``/``_sum``, the total over every label set."""
    totals: dict[str, float] = defaultdict(float)
    for (name, _), value in scraped.items():
        if name.endswith(("_total", "_count", "_sum")):
            totals[name] += value
    return totals


# -- prometheus_client's own files, the host's metrics ---------------------------------------------------------------


def _write_host_files(folder: str) -> dict[str, bytes]:
    """The host's own prometheus_client files (pids 101 and 103, which die): what they hold, byte for byte."""
    host = {f"counter_{PIDS[0]}.db": [(_key("host_requests", "host_requests_total"), 7.0, 0.0)],
            f"gauge_livesum_{PIDS[2]}.db": [(_key("host_inflight", "host_inflight"), 2.0, 0.0)],
            f"gauge_livemostrecent_{PIDS[0]}.db": [(_key("host_version", "host_version"), 3.0, 5.0)],
            f"histogram_{PIDS[2]}.db": [(_key("host_h", "host_h_bucket", le="1.0"), 4.0, 0.0),
                                        (_key("host_h", "host_h_sum"), 2.5, 0.0)]}
    for name, entries in host.items():
        file = MmapedDict(os.path.join(folder, name))
        for key, value, timestamp in entries:
            file.write_value(key, value, timestamp)
        file.close()
    return {name: open(os.path.join(folder, name), "rb").read() for name in host}


def _check_host_files(folder: str, host: dict[str, bytes]) -> None:
    """prometheus_client's files are as the host wrote them: no `ProcessFiles` write, exit or reap touched them."""
    for name, data in host.items():
        with open(os.path.join(folder, name), "rb") as file:
            assert file.read() == data, name


def _check_own_files(folder: str, files: dict[tuple[str, int], Content], host: dict[str, bytes]) -> None:
    """Each own file holds exactly the model's keys, values and timestamps; one the model holds nothing for (never
    written, or removed at exit or by a reap) is not there; nothing else is in the folder (no staging file)."""
    own = {}
    for name in os.listdir(folder):
        if name in host:
            continue
        kind, _, pid = name.removesuffix(".db").rpartition("_asyncllm_")
        assert name.endswith(".db") and kind in KINDS and pid.isdigit(), name
        own[(kind, int(pid))] = _read(os.path.join(folder, name))
    for where, content in own.items():
        assert where in files, f"{where}: a file the model says is gone (or never written)"
        assert content == files[where], where
    for where, content in files.items():
        assert where in own or not content, f"{where}: the model's keys are not in the folder"


# -- `ProcessFiles` directly -----------------------------------------------------------------------------------------


class Watch:
    """Checks every value written while a `ProcessFiles.write` runs: the old contents until a new file is renamed
    over, the new ones right after; in place, every key keeps its old or its new value."""

    def __init__(self, folder: str, host_scrape: Scrape) -> None:
        self.folder, self.host_scrape = folder, host_scrape
        self.before: dict[tuple[str, int], Content] | None = None
        self.after: dict[tuple[str, int], Content] = {}
        self.where: tuple[str, int] = ("", 0)

    def expected(self, files: dict[tuple[str, int], Content]) -> Scrape:
        return {**self.host_scrape, **_model_scrape(files)}

    def value_written(self, file: MmapedDict) -> None:
        if self.before is None:
            return
        path = os.path.join(self.folder, f"{self.where[0]}_asyncllm_{self.where[1]}.db")
        renamed = os.path.exists(path) and os.path.samestat(os.fstat(file._f.fileno()), os.stat(path))
        old, new = self.before.get(self.where, {}), self.after.get(self.where, {})
        if not renamed:  # a file written anew, not renamed over `path` yet: no scrape reads it, `path` is as it was
            assert not file._fname.endswith(".db"), "a scrape reads every *.db file"  # `MultiProcessCollector`'s glob
            assert (_read(path) if os.path.exists(path) else {}) == old
            return
        now = _read(path)
        assert old.keys() <= now.keys() <= old.keys() | new.keys(), "a key left a file written in place"
        for key, value in now.items():
            assert value in (old.get(key), new.get(key)), key

    def replace(self, staging: str, path: str) -> None:
        if self.before is None:
            os.replace(staging, path)
            return
        assert not staging.endswith(".db") and path.endswith(".db")
        assert _scrape(self.folder) == self.expected(self.before)
        assert _read(staging) == self.after.get(self.where, {})
        os.replace(staging, path)
        assert _scrape(self.folder) == self.expected(self.after)


class Process:
    """One simulated process: its `ProcessFiles` and what it would write of each kind."""

    def __init__(self, folder: str, pid: int) -> None:
        self.files = ProcessFiles(folder, pid)
        self.own: dict[str, dict[str, float]] = {"counter": {}, "histogram": {}}
        self.gauges: dict[str, float] = {}
        self.written: set[str] = set()
        """The kinds it wrote (its first write of one takes a dead process's file of that pid as its baseline)."""
        self.baseline: dict[str, dict[str, float]] = {}


class FilesModel:
    """The folder as the docs describe it, and the simulated processes driving the real `ProcessFiles`."""

    def __init__(self, folder: str, watch: Watch) -> None:
        self.folder, self.watch = folder, watch
        self.running: dict[int, Process] = {}
        self.files: dict[tuple[str, int], Content] = {}
        self.now = 1.0

    def apply(self, op: str, pid: int, a: int, b: int) -> None:
        self.now += 1.0
        process = self.running.get(pid)
        if op == "start" and process is None:
            self.running[pid] = Process(self.folder, pid)
        elif op == "reap":
            reap_dead(self.folder, lambda other: other in self.running)
            for where in [w for w in self.files if w[0] == LIVE_GAUGES and w[1] not in self.running]:
                del self.files[where]
        elif process is None:
            return
        elif op == "count":
            family = ("asyncllm:c", "asyncllm:e")[a % 2]
            key = _counter_key(family, MODELS[a // 2 % 2])
            process.own["counter"][key] = process.own["counter"].get(key, 0.0) + b
        elif op == "observe":
            model, value = MODELS[a % 2], (0.25, 2.0)[b % 2]
            histogram = process.own["histogram"]
            for key, add in ((_bucket_key(model, ("0.5", "+Inf")[b % 2]), 1.0),
                             (_key("asyncllm:h", "asyncllm:h_sum", model_name=model), value)):
                histogram[key] = histogram.get(key, 0.0) + add
        elif op == "gauge":
            key = _gauge_key(a % (len(ADAPTER_SETS) + 1), MODELS[a // 6])  # model m's keys mostly: shared more
            if b >= 2:
                process.gauges[key] = float(b)
            elif process.gauges:  # the adapter set no longer runs, the engine closed: that key, else one it has
                process.gauges.pop(key if key in process.gauges else sorted(process.gauges)[a % len(process.gauges)])
        elif op == "rename":
            old, new = MODELS[a % 2], MODELS[1 - a % 2]
            for own in process.own.values():
                for key in [k for k in own if _renamed(k, old, new) != k]:
                    moved = _renamed(key, old, new)
                    own[moved] = own.get(moved, 0.0) + own.pop(key)
        elif op == "write":
            self.write(pid, process)
        elif op == "exit":
            process.files.remove_live()
            self.files.pop((LIVE_GAUGES, pid), None)
            del self.running[pid]
        elif op == "kill":
            del self.running[pid]

    def write(self, pid: int, process: Process) -> None:
        """`_Writer._write`: each kind's entries, counters and histograms at timestamp 0, gauges at `now`."""
        entries = {kind: {key: (value, 0.0) for key, value in own.items()} for kind, own in process.own.items()}
        entries[LIVE_GAUGES] = {key: (value, self.now) for key, value in process.gauges.items()}
        for kind in KINDS:
            if kind not in process.written:
                process.written.add(kind)
                dead = self.files.get((kind, pid), {}) if kind in CARRIED_ON else {}
                process.baseline[kind] = {key: value for key, (value, _) in dead.items()}
            baseline = process.baseline[kind]
            content = {key: (value, 0.0) for key, value in baseline.items()}
            for key, (value, timestamp) in entries[kind].items():
                content[key] = (baseline.get(key, 0.0) + value, timestamp)
            after = {**self.files, (kind, pid): content}
            self.watch.before, self.watch.after, self.watch.where = self.files, after, (kind, pid)
            try:
                process.files.write(kind, entries[kind])
            finally:
                self.watch.before = None
            self.files = after


class _WatchedDict(MmapedDict):
    """`MmapedDict` as `ProcessFiles` writes it, each value written then checked (`Watch.value_written`)."""

    watch: Watch | None = None

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        super().write_value(key, value, timestamp)
        if _WatchedDict.watch is not None:
            _WatchedDict.watch.value_written(self)


class _WatchedOs:
    """`os` for `multiprocess_files`, its `replace` checked (`Watch.replace`)."""

    def __init__(self, watch: Watch) -> None:
        self.replace = watch.replace

    def __getattr__(self, name: str):
        return getattr(os, name)


FILE_OPS = ("start", "count", "observe", "gauge", "rename", "write", "exit", "kill", "reap")


def _drawn_ops(draw, ops: tuple[str, ...], size: int, a_max: int, b_max: int) -> list[tuple[str, int, int, int]]:
    """Operations as a host's processes do them: a start takes a pid not running (a dead one's: pid reuse), any
    other operation a running process (none running: a start); a reap happens in a running process."""
    running: list[int] = []
    drawn = []
    for _ in range(draw(st.integers(size // 3, size))):
        op = draw(st.sampled_from(ops))
        if op == "start" and len(running) < len(PIDS) or not running:
            pid = draw(st.sampled_from([p for p in PIDS if p not in running]))
            running.append(pid)
            drawn.append(("start", pid, draw(st.integers(0, a_max)), 0))
            continue
        pid = draw(st.sampled_from(running))
        if op in ("exit", "kill"):
            running.remove(pid)
        drawn.append((op, pid, draw(st.integers(0, a_max)), draw(st.integers(0, b_max))))
    return drawn


@st.composite
def file_scenarios(draw) -> list[tuple[str, int, int, int]]:
    more = ("start", "start", "count", "observe", "gauge", "gauge", "gauge", "write", "write", "write")
    return _drawn_ops(draw, FILE_OPS + more, 40, 7, 5)


def _starts(*pids: int) -> list[tuple[str, int, int, int]]:
    return [("start", pid, 0, 0) for pid in pids]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=file_scenarios())
# pid reuse: 101 killed after writing a counter, a histogram and a gauge; its successor's first write adds its own
# counts to the dead ones (no reset), keeps the dead keys it does not write, and drops the dead gauge file
@example(ops=[*_starts(101), ("count", 101, 0, 5), ("observe", 101, 0, 1), ("gauge", 101, 0, 3), ("write", 101, 0, 0),
              ("kill", 101, 0, 0), ("start", 101, 0, 0), ("count", 101, 2, 1), ("write", 101, 0, 0)])
# a killed process's gauges stay until a running one reaps them; a clean exit removes its own at once
@example(ops=[*_starts(101, 102), ("gauge", 101, 1, 4), ("gauge", 102, 1, 5), ("write", 101, 0, 0),
              ("write", 102, 0, 0), ("kill", 102, 0, 0), ("reap", 101, 0, 0), ("exit", 101, 0, 0)])
# a LoRA adapter set no longer running leaves the gauge file (written anew); a key added in place leaves too
@example(ops=[*_starts(101), ("gauge", 101, 2, 2), ("write", 101, 0, 0), ("gauge", 101, 2, 0), ("gauge", 101, 3, 2),
              ("write", 101, 0, 0), ("gauge", 101, 1, 3), ("write", 101, 0, 0), ("gauge", 101, 1, 0),
              ("write", 101, 0, 0)])
# a renamed model: its counters leave the file for the new name; the total stays; the dead baseline's old keys stay
@example(ops=[*_starts(101), ("count", 101, 0, 2), ("write", 101, 0, 0), ("kill", 101, 0, 0), ("start", 101, 0, 0),
              ("count", 101, 0, 1), ("write", 101, 0, 0), ("rename", 101, 0, 0), ("write", 101, 0, 0)])
# the most recent gauge wins across processes (not the sum, not the highest); the later writer exits: the earlier's
# value shows again
@example(ops=[*_starts(101, 102), ("gauge", 101, 0, 4), ("gauge", 102, 0, 2), ("write", 101, 0, 0),
              ("write", 102, 0, 0), ("exit", 102, 0, 0), ("start", 102, 0, 0), ("write", 102, 0, 0)])
# a dead process's gauge file replaced by an empty write of its successor (its gauges leave, none of its own)
@example(ops=[*_starts(103), ("gauge", 103, 0, 2), ("write", 103, 0, 0), ("kill", 103, 0, 0), ("start", 103, 0, 0),
              ("write", 103, 0, 0)])
def test_process_files_match_the_model(ops: list[tuple[str, int, int, int]]) -> None:
    """After every operation the scrape, each own file and prometheus_client's files are the model's; during every
    write no half-written file is read."""
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        host = _write_host_files(folder)
        watch = Watch(folder, _scrape(folder))
        assert watch.host_scrape[("host_requests_total", ())] == 7  # the host's series are in the scrape
        patch.setattr(multiprocess_files, "MmapedDict", _WatchedDict)
        patch.setattr(_WatchedDict, "watch", watch)
        patch.setattr(multiprocess_files, "os", _WatchedOs(watch))
        model = FilesModel(folder, watch)
        totals: dict[str, float] = {}
        for op in ops:
            model.apply(*op)
            scraped = _scrape(folder)
            assert scraped == watch.expected(model.files), op
            _check_own_files(folder, model.files, host)
            _check_host_files(folder, host)
            now = _monotone_totals(scraped)
            assert all(now.get(name, 0.0) >= total for name, total in totals.items()), op  # no reset seen
            totals = now


# -- the writer (`_Writer`) over `ProcessFiles` ----------------------------------------------------------------------


class Host:
    """One simulated host process: its `_Writer` of that pid over one collector of one named `HostStats`."""

    def __init__(self, pid: int, model: str) -> None:
        self.stats = HostStats(model)
        self.stats.owns_core = True
        self.collector = AsyncLLMCollector()  # held here: the writer holds it weakly
        self.collector.add(self.stats)
        self.writer = multiprocess._Writer(pid)
        self.writer.collectors.add(self.collector)
        self.shown: Scrape = {}
        """Its counters and histograms as its own registry showed them at its last write (or an earlier one that
        showed a series the last one did not)."""

    def collected(self) -> tuple[Scrape, Scrape]:
        """Its one-process registry now: (counters and histograms, gauges)."""
        counted, gauges = {}, {}
        for family in self.collector.collect():
            for s in family.samples:
                (gauges if family.type == "gauge" else counted)[(s.name, _labels(s.labels))] = s.value
        return counted, gauges


class WriterModel:
    """Hosts in drawn orders; the model: each process's last write (counters summed over every process, dead ones
    too), and each pid's gauge file (the latest write wins, gone at exit or reap)."""

    def __init__(self, folder: str, clock: list[float]) -> None:
        self.folder, self.clock = folder, clock
        self.running: dict[int, Host] = {}
        self.every: list[Host] = []
        self.gauge_files: dict[int, tuple[Scrape, float]] = {}

    def apply(self, op: str, pid: int, a: int, b: int) -> None:
        self.clock[0] += 1.0
        host = self.running.get(pid)
        if op == "start" and host is None:
            self.running[pid] = Host(pid, MODELS[a % 2])
            self.every.append(self.running[pid])
        elif op == "reap":
            reap_dead(self.folder, lambda other: other in self.running)
            self.gauge_files = {p: file for p, file in self.gauge_files.items() if p in self.running}
        elif host is None:
            return
        elif op == "finish":
            host.stats.generation_tokens_total += a
            host.stats.count_finished(("stop", "length")[b % 2])
        elif op == "observe":
            host.stats.time_to_first_token.observe((0.25, 2.0, 64.0)[b % 3])
        elif op == "snapshot":
            adapters = [name for name in ADAPTER_SETS[b % 3].split(",") if name]
            host.stats.take_snapshot(SchedulerStats(num_requests_running=a, max_lora=2 if b % 2 else 0,
                                                    running_lora_adapters=adapters), True)
        elif op == "close":
            host.stats.mark_closed()
        elif op == "sync":
            host.writer.sync()
            self.written(pid, host)
        elif op == "exit":
            multiprocess._at_exit(host.writer)
            self.written(pid, host)
            del self.gauge_files[pid], self.running[pid]
        elif op == "kill":
            del self.running[pid]

    def written(self, pid: int, host: Host) -> None:
        counted, gauges = host.collected()
        host.shown.update(counted)  # a series its registry no longer shows (an engine closed at 0) is not taken back
        self.gauge_files[pid] = (gauges, self.clock[0])

    def expected(self) -> Scrape:
        scraped: Scrape = defaultdict(float)
        for host in self.every:
            for series, value in host.shown.items():
                scraped[series] += value
        latest: dict[tuple, tuple[float, float]] = {}
        for gauges, written_at in self.gauge_files.values():
            for series, value in gauges.items():
                if series not in latest or latest[series][1] < written_at:
                    latest[series] = (value, written_at)
        return {**scraped, **{series: value for series, (value, _) in latest.items()}}


WRITER_OPS = ("start", "finish", "observe", "snapshot", "close", "sync", "exit", "kill", "reap")


@st.composite
def writer_scenarios(draw) -> list[tuple[str, int, int, int]]:
    return _drawn_ops(draw, WRITER_OPS + WRITER_OPS[1:6] + ("sync",), 25, 4, 5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=writer_scenarios())
# a killed host's pid reused by a host of another model: the dead one's m series stay, its gauges leave at the
# successor's first write; then the successor exits: its n gauges leave, every counter stays
@example(ops=[("start", 101, 0, 0), ("finish", 101, 3, 0), ("observe", 101, 0, 1), ("snapshot", 101, 2, 1),
              ("sync", 101, 0, 0), ("kill", 101, 0, 0), ("start", 101, 1, 0), ("finish", 101, 1, 1),
              ("sync", 101, 0, 0), ("snapshot", 101, 1, 2), ("exit", 101, 0, 0)])
# two hosts of one model: counters summed, the latest reporter's gauges; an adapter set that stops running leaves;
# a killed host's gauges reaped by the other, its counters kept
@example(ops=[("start", 101, 0, 0), ("start", 102, 0, 0), ("snapshot", 101, 1, 1), ("snapshot", 102, 2, 3),
              ("finish", 101, 2, 0), ("finish", 102, 4, 0), ("sync", 101, 0, 0), ("sync", 102, 0, 0),
              ("snapshot", 102, 2, 5), ("sync", 102, 0, 0), ("kill", 102, 0, 0), ("reap", 101, 0, 0)])
# an engine closed: its gauges leave the file, its counters stay; the same pid reused twice
@example(ops=[("start", 103, 0, 0), ("snapshot", 103, 3, 1), ("sync", 103, 0, 0), ("close", 103, 0, 0),
              ("finish", 103, 2, 0), ("sync", 103, 0, 0), ("exit", 103, 0, 0), ("start", 103, 0, 0),
              ("finish", 103, 1, 0), ("exit", 103, 0, 0), ("start", 103, 0, 0), ("sync", 103, 0, 0)])
def test_writer_matches_the_model(ops: list[tuple[str, int, int, int]]) -> None:
    """After every operation the scrape is the model's (counters never reset, dead gauges gone, prometheus_client's
    files untouched); at the end `multiprocess_latest()` serves the same series."""
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        patch.setenv("PROMETHEUS_MULTIPROC_DIR", folder)
        patch.setattr(multiprocess, "_writer", None)  # `multiprocess_latest` syncs no writer of this process
        clock = [1000.0]
        fake_time = SimpleNamespace(time=lambda: clock[0])
        patch.setattr(multiprocess, "time", fake_time)
        patch.setattr(prometheus, "time", fake_time)  # `lora_requests_info`'s value
        host = _write_host_files(folder)
        host_scrape = _scrape(folder)
        model = WriterModel(folder, clock)
        totals: dict[str, float] = {}
        for op in ops:
            model.apply(*op)
            scraped = _scrape(folder)
            assert scraped == {**host_scrape, **model.expected()}, op
            _check_host_files(folder, host)
            assert not [name for name in os.listdir(folder) if not name.endswith(".db")], op  # no staging file
            for pid in PIDS:
                assert os.path.exists(os.path.join(folder, f"{LIVE_GAUGES}_asyncllm_{pid}.db")) <= (
                    pid in model.gauge_files), op
            now = _monotone_totals(scraped)
            assert all(now.get(name, 0.0) >= total for name, total in totals.items()), op  # no reset seen
            totals = now
        served = {(s.name, _labels(s.labels)): s.value
                  for family in text_string_to_metric_families(multiprocess.multiprocess_latest().decode())
                  for s in family.samples}
        assert served == _scrape(folder)
