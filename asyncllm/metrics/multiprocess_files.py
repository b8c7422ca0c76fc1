"""The ``asyncllm:`` series' own files in ``PROMETHEUS_MULTIPROC_DIR`` (`ProcessFiles`), apart from prometheus_client's.

prometheus_client's files (``counter_<pid>.db``) may hold the host's own metrics,
and a key written there is never removed (client_python#720): a model renamed or
a LoRA adapter set no longer in use would stay in them for good. The writer's
series go to files of their own, ``<kind>_asyncllm_<pid>.db``, which
`MultiProcessCollector` reads as any other (it takes the type, and a gauge's
mode, from the name before the first ``_asyncllm``). A file that would lose keys
is written anew beside it and renamed over it: a scrape reads the old file or
the new one, never half of one.

`prometheus_client.multiprocess.mark_process_dead(pid)` does not know these
names: a process removes its gauge file at exit (`ProcessFiles.remove_live`),
and the live processes remove those of processes killed meanwhile (`reap_dead`).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Iterable

from prometheus_client.mmap_dict import MmapedDict

from asyncllm.procutil import remove_file

__all__ = ["LIVE_GAUGES", "ProcessFiles", "reap_dead", "reported_elsewhere"]

LIVE_GAUGES = "gauge_livemostrecent"
"""The gauges' kind: prometheus_client's ``livemostrecent`` mode (a dead process's gauges leave with its file)."""
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

    def path(self, kind: str) -> str:
        return os.path.join(self.folder, f"{kind}_asyncllm_{self.pid}.db")

    def write(self, kind: str, entries: Entries) -> None:
        """Make the file of `kind` hold `entries`: in place, or written anew when a key leaves (or on first use)."""
        if kind not in self._files:
            if entries:
                self._rewrite(kind, entries)
            return
        if self._keys[kind] - entries.keys():
            self._rewrite(kind, entries)
            return
        file = self._files[kind]
        for key, (value, timestamp) in entries.items():
            file.write_value(key, value, timestamp)
        self._keys[kind] = set(entries)

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
