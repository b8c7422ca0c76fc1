"""The ``asyncllm:`` series' own files in ``PROMETHEUS_MULTIPROC_DIR`` (`ProcessFiles`), apart from prometheus_client's.

prometheus_client's files (``counter_<pid>.db``) may hold the host's own metrics,
and a key written there is never removed (client_python#720): a model renamed or
a LoRA adapter set no longer in use would stay in them for good. The writer's
series go to files of their own, ``<kind>_asyncllm_<pid>.db``, which
`MultiProcessCollector` reads as any other (it takes the type, and a gauge's
mode, from the name before the first ``_asyncllm``). A file that would lose keys
is written anew beside it and renamed over it: a scrape reads the old file or
the new one, never half of one.

A pid is reused (a container restarted with the same low pids, the folder
kept): the first write of a counter or histogram file that a dead process of
that pid left takes its values as a baseline and adds to them, as
prometheus_client's own files carry on (a scrape sees no counter reset). Its
live gauges are not carried: a dead process's gauges leave, as
`mark_process_dead` removes prometheus_client's.

`prometheus_client.multiprocess.mark_process_dead(pid)` does not know these
names: a process removes its gauge file at exit (`ProcessFiles.remove_live`),
and the live processes remove those of processes killed meanwhile (`reap_dead`).
Files named by pid, as prometheus_client's are, and liveness by pid: the folder
belongs to one pid namespace (docs/observability.md), not a volume shared by
containers.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Iterable

from prometheus_client.mmap_dict import MmapedDict

from asyncllm.procutil import remove_file

__all__ = ["CARRIED_ON", "LIVE_GAUGES", "ProcessFiles", "reap_dead", "reported_elsewhere"]

LIVE_GAUGES = "gauge_livemostrecent"
"""The gauges' kind: prometheus_client's ``livemostrecent`` mode (a dead process's gauges leave with its file)."""
CARRIED_ON = ("counter", "histogram")
"""The kinds whose values a dead process of the same pid left are added to (`ProcessFiles.write`)."""
_OWN_LIVE_FILE = re.compile(rf"^{LIVE_GAUGES}_asyncllm_(\d+)\.db$")

Entries = dict[str, tuple[float, float]]
"""prometheus_client's key (`mmap_key`) -> (value, timestamp)."""


class ProcessFiles:
    """One process's files, one per kind ("counter", "histogram", `LIVE_GAUGES`), each holding what the last
    `write` of its kind gave it and nothing else."""

    def __init__(self, folder: str, pid: int) -> None:
        self.folder, self.pid = folder, pid
        self._files: dict[str, MmapedDict] = {}
        self._keys: dict[str, set[str]] = {}
        """Per kind, the keys its file holds."""
        self._baseline: dict[str, dict[str, float]] = {}
        """Per kind, what a dead process of this pid left in its file (`CARRIED_ON` kinds only)."""

    def path(self, kind: str) -> str:
        return os.path.join(self.folder, f"{kind}_asyncllm_{self.pid}.db")

    def write(self, kind: str, entries: Entries) -> None:
        """Make the file of `kind` hold `entries` (over the baseline, `CARRIED_ON`): in place, or written anew
        when a key leaves (or on first use)."""
        entries = self._carried_on(kind, entries)
        if kind not in self._files:
            if entries or os.path.exists(self.path(kind)):  # a dead process of this pid's: its gauges leave
                self._rewrite(kind, entries)
            return
        if self._keys[kind] - entries.keys():
            self._rewrite(kind, entries)
            return
        file = self._files[kind]
        for key, (value, timestamp) in entries.items():
            file.write_value(key, value, timestamp)
        self._keys[kind] = set(entries)

    def _carried_on(self, kind: str, entries: Entries) -> Entries:
        if kind not in self._baseline:  # first use: read before this process's first write replaces the file
            self._baseline[kind] = _values(self.path(kind)) if kind in CARRIED_ON else {}
        baseline = self._baseline[kind]
        if not baseline:
            return entries
        carried = {key: (value, 0.0) for key, value in baseline.items()}
        for key, (value, timestamp) in entries.items():
            carried[key] = (baseline.get(key, 0.0) + value, timestamp)
        return carried

    def _rewrite(self, kind: str, entries: Entries) -> None:
        path = self.path(kind)
        staging = path + ".tmp"  # not *.db: no scrape reads it
        remove_file(staging)  # a crashed rewrite's
        file = MmapedDict(staging)
        for key, (value, timestamp) in entries.items():
            file.write_value(key, value, timestamp)
        os.replace(staging, path)  # `file` maps the renamed file: later writes go to `path`
        old = self._files.get(kind)
        self._files[kind], self._keys[kind] = file, set(entries)
        if old is not None:
            old.close()

    def remove_live(self) -> None:
        """The process ends: its gauges leave (as `mark_process_dead` removes prometheus_client's)."""
        remove_file(self.path(LIVE_GAUGES))


def _values(path: str) -> dict[str, float]:
    try:
        return {key: value for key, value, *_ in MmapedDict.read_all_values_from_file(path)}
    except FileNotFoundError:
        return {}


def reap_dead(folder: str, running: Callable[[int], bool]) -> None:
    """Remove the gauge files of processes no longer `running` (a worker killed by SIGKILL runs no atexit hook)."""
    for name in os.listdir(folder):
        match = _OWN_LIVE_FILE.match(name)
        if match is not None and not running(int(match.group(1))):
            remove_file(os.path.join(folder, name))


def reported_elsewhere(folder: str, keys: Iterable[str]) -> set[str]:
    """Which of the counter `keys` (`mmap_key`s) a counter file in `folder` holds: one pass over the files."""
    wanted, found = set(keys), set()
    for path in glob.glob(os.path.join(folder, "counter_*.db")):
        try:
            found.update(key for key, *_ in MmapedDict.read_all_values_from_file(path) if key in wanted)
        except FileNotFoundError:
            continue
    return found
