"""The summary of a worker's step trace (torch.profiler's, workers/step_trace.py), and its files' names.

A worker traced by ``ASYNCLLM_WORKER_TRACE_STEPS`` (workers/step_trace.py)
marks each step with a ``asyncllm::step`` span and its phases with
``asyncllm::<phase>`` spans: ``launch`` (the runner's launch of the step, or
the whole step where it is not pipelined) and within it ``update`` (the
batch's state diffs), ``prepare`` (the step's inputs), ``forward`` (the
model, or its CUDA graph's replay), ``logits``, ``sample``; then ``finish``
(waiting for an earlier launched step's sampled ids and building its output)
and ``send``. `summarize` reads the exported trace: step k's window is the
host's time from the start of step k to the start of step k + 1 (one turn of
the worker's loop; ``other`` is what of it no phase covers: reading the next
command, waiting for it). Device work (CUDA kernels, copies and fills; on a
CPU, the aten operators) belongs to the window whose host launched it; each
idle gap of the device belongs to the window of the work that ends it, and
is ``between`` steps when that work is its window's first, ``within`` a step
otherwise. A window's device busy plus idle time is its share of the
device's timeline: their mean is the token period at batch 1. The first
window's idle time is null (the gap before its work is not in the trace), and
the means and medians leave it out.
"""

from __future__ import annotations

import bisect
import glob
import logging
import os
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from asyncllm import envs

logger = logging.getLogger(__name__)

__all__ = ["PHASE_PREFIX", "STEP_SPAN", "END_MARK", "KERNEL_KINDS", "kernel_kind", "summarize", "trace_dir",
           "writing_marker", "wait_for_exit", "TRACE_WRITE_WAIT_S"]

PHASE_PREFIX = "asyncllm::"
STEP_SPAN = PHASE_PREFIX + "step"
END_MARK = PHASE_PREFIX + "trace_end"
"""An empty span the worker records as its trace stops: the end of the last step's window."""
_TOP_PHASES = ("launch", "finish", "send")
"""The phases that do not nest in each other; the rest nest in ``launch``."""
_DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_TOP_GAPS = 10

KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # first match wins: our Triton kernels by name, then the vendor libraries' and aten's names
    ("attention", ("paged_attention", "decode_segment", "decode_combine", "flash", "attention", "sdpa", "fmha")),
    ("rotary", ("rotary",)),
    ("norm", ("rms_norm", "layer_norm", "norm")),
    ("activation", ("silu", "gelu", "act_and_mul")),
    ("matmul", ("gemm", "matmul", "cutlass", "cublas", "nvjet", "xmma", "aten::mm", "aten::addmm", "aten::linear",
                "aten::bmm")),
    ("sampling", ("argmax", "softmax", "exponential", "sort", "topk", "cumsum", "multinomial")),
    ("copy", ("memcpy", "memset", "copy", "index", "cat", "fill", "gather", "scatter")),
)
"""Kernel kinds and the (lower-case) name fragments that mark them."""


def kernel_kind(name: str) -> str:
    """The kind of a kernel or operator, from its name; ``other`` when nothing matches."""
    lowered = name.lower()
    for kind, fragments in KERNEL_KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def summarize(events: list[dict[str, Any]], on_cuda: bool, first_step: int = 0) -> dict[str, Any]:
    """The summary of a chrome trace's events (torch.profiler's ``export_chrome_trace``): per step window its host
    phases and device busy and idle time, the device time by kernel kind, the largest idle gaps and where. Steps are
    numbered from `first_step` (the executed step the trace began with)."""
    spans = sorted(((e["ts"], e["ts"] + e.get("dur", 0.0), e["name"]) for e in events
                    if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith(PHASE_PREFIX)),
                   key=lambda span: (span[0], -span[1]))  # of two spans starting together, the outer first
    starts = [s for s, _, name in spans if name == STEP_SPAN]
    if not starts:
        return {"num_steps": 0}
    end = max([s for s, _, name in spans if name == END_MARK] or [max(e for _, e, _ in spans)])
    bounds = starts + [end]
    windows = [_window(first_step + k, bounds[k + 1] - bounds[k]) for k in range(len(starts))]
    for s, e, name in spans:
        k = bisect.bisect_right(starts, s) - 1
        if k >= 0 and name not in (STEP_SPAN, END_MARK):
            phases = windows[k]["host_ms"]
            phases[name[len(PHASE_PREFIX):]] = phases.get(name[len(PHASE_PREFIX):], 0.0) + (e - s) / 1e3
    for w in windows:
        w["host_ms"]["other"] = w["wall_ms"] - sum(w["host_ms"].get(p, 0.0) for p in _TOP_PHASES)
    device = _device_events(events, on_cuda, starts)
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    gaps = _walk(device, windows, kinds, kernel_kind)
    for w in windows:
        w["device_idle_ms"] = w["idle_between_ms"] + w["idle_within_ms"]
    windows[0]["idle_between_ms"] = windows[0]["device_idle_ms"] = None  # its gap before is not in the trace
    for gap in gaps + [w["largest_gap"] for w in windows if w["largest_gap"]]:
        gap["host_at_start"] = _innermost(spans, gap.pop("_at"))
        gap["next_launched_in"] = _innermost(spans, gap.pop("_launch"))
    num = len(windows)
    return {
        "device_events": "CUDA kernels, copies and fills" if on_cuda else "aten operators (no device: the CPU's own)",
        "num_steps": num,
        "mean": _stats(windows, statistics.fmean),
        "median": _stats(windows, statistics.median),
        "kinds_ms_per_step": {kind: {"ms": ms / num, "launches": n / num}
                              for kind, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
        "top_gaps": gaps[:_TOP_GAPS],
        "steps": [_rounded(w) for w in windows],
    }


def _window(step: int, wall_us: float) -> dict[str, Any]:
    return {"step": step, "wall_ms": wall_us / 1e3, "host_ms": {}, "device_busy_ms": 0.0, "idle_between_ms": 0.0,
            "idle_within_ms": 0.0, "kernels": 0, "largest_gap": None}


def _device_events(events: list[dict[str, Any]], on_cuda: bool, starts: list[float]) -> list[tuple[float, ...]]:
    """(start, end, name, step window, launch time) of the device's work launched in a window, by start."""
    if on_cuda:
        launched = {e["args"]["correlation"]: e["ts"] for e in events if e.get("ph") == "X"
                    and e.get("cat") not in _DEVICE_CATS and "correlation" in e.get("args", {})}
        work = [(e, launched.get(e.get("args", {}).get("correlation"), e["ts"])) for e in events
                if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS]
    else:
        work = [(e, e["ts"]) for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                and e["name"].startswith("aten::")]
    out = []
    for e, launch in work:
        k = bisect.bisect_right(starts, launch) - 1
        if k >= 0:
            out.append((e["ts"], e["ts"] + e.get("dur", 0.0), e["name"], k, launch))
    return sorted(out)


def _walk(device: list[tuple[Any, ...]], windows: list[dict[str, Any]], kinds: dict[str, list[float]],
          kind_of: Callable[[str], str]) -> list[dict[str, Any]]:
    """Each work item's busy time (what of it no earlier item covers) and the idle gap before it into its window
    and kind; the largest gaps, largest first."""
    gaps = []
    busy_end, last_name, last_window = None, "", -1
    for start, end, name, k, launch in device:
        w = windows[k]
        w["kernels"] += 1
        kinds[kind_of(name)][1] += 1
        if busy_end is not None and start > busy_end:
            gap = {"ms": (start - busy_end) / 1e3, "step": w["step"], "between_steps": last_window != k,
                   "after": last_name, "next": name, "_at": busy_end, "_launch": launch}
            w["idle_between_ms" if gap["between_steps"] else "idle_within_ms"] += gap["ms"]
            if w["largest_gap"] is None or gap["ms"] > w["largest_gap"]["ms"]:
                w["largest_gap"] = gap
            gaps.append(gap)
        busy = max(0.0, end - max(start, busy_end if busy_end is not None else start)) / 1e3
        w["device_busy_ms"] += busy
        kinds[kind_of(name)][0] += busy
        if busy_end is None or end >= busy_end:
            busy_end, last_name, last_window = end, name, k
    gaps.sort(key=lambda g: -g["ms"])
    return [dict(g) for g in gaps[:_TOP_GAPS]]  # copies: a window's largest gap may be one of them too


def _innermost(spans: list[tuple[float, float, str]], t: float) -> str:
    """The innermost ``asyncllm::`` span around time `t` (the latest started that holds it): the host's phase then;
    ``outside a step`` when none does."""
    inside = [name for s, e, name in spans if s <= t <= e and name != END_MARK]
    return inside[-1][len(PHASE_PREFIX):] if inside else "outside a step"


def _stats(windows: list[dict[str, Any]], of: Callable[[list[float]], float]) -> dict[str, Any]:
    keys = ("wall_ms", "device_busy_ms", "device_idle_ms", "idle_between_ms", "idle_within_ms", "kernels")
    values = {key: [w[key] for w in windows if w[key] is not None] for key in keys}
    out: dict[str, Any] = {key: of(v) if v else None for key, v in values.items()}  # one window: no idle time
    phases = sorted({p for w in windows for p in w["host_ms"]})
    out["host_ms"] = {p: of([w["host_ms"].get(p, 0.0) for w in windows]) for p in phases}
    return out


def _rounded(value: Any) -> Any:
    """Milliseconds to the microsecond's tenth, so the per-step list stays compact."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def trace_dir() -> str:
    """``ASYNCLLM_WORKER_TRACE_DIR``, else asyncllm-worker-trace in the system temp dir."""
    return envs.WORKER_TRACE_DIR.get() or os.path.join(tempfile.gettempdir(), "asyncllm-worker-trace")


# ------------------------------------------------------------ the shutdown's wait for a trace being written
_WRITING = "worker-trace-writing-"
TRACE_WRITE_WAIT_S = 300.0
"""The longest a shutdown waits past its grace for a worker writing its step trace: a worker hung there (the
profiler's stop synchronizes the device, a GPU hang hangs it) is then stopped as any other."""


def writing_marker(pid: int | str, core: int | None = None) -> str:
    """The file there while worker `pid` of engine core `core` stops its profiler and writes its trace
    (`TracedPipeline`); `core` None: the core that started this process (its executor sets `envs.CORE_PID_NAME`)."""
    owner = os.environ.get(envs.CORE_PID_NAME, "0") if core is None else core
    return os.path.join(trace_dir(), f"{_WRITING}{owner}-{pid}")


def _writing(proc: subprocess.Popen, pid: int | None) -> bool:
    """Whether our worker `pid` (None: any live worker of the core `proc`, for its host) writes its trace now;
    False at once unless workers trace."""
    if envs.WORKER_TRACE_STEPS.get() is None:
        return False
    if pid is not None:
        return os.path.exists(writing_marker(pid, os.getpid()))
    from asyncllm.metrics.multiprocess import pid_running  # (a marker left by a killed worker is not waited for)

    markers = glob.glob(os.path.join(glob.escape(trace_dir()), f"{_WRITING}{proc.pid}-*"))
    return any(pid_running(int(path.rsplit("-", 1)[1])) for path in markers)


def wait_for_exit(proc: subprocess.Popen, grace: float, pid: int | None = None) -> None:
    """Wait up to `grace` seconds for `proc` to exit, and on past them while our worker `pid` (None: a worker of
    the core `proc`, for its host) writes its step trace, for `TRACE_WRITE_WAIT_S` at most: a shutdown never cuts
    one, nor waits forever for a hung one."""
    deadline = time.monotonic() + grace
    last = deadline + TRACE_WRITE_WAIT_S
    while True:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return
        except subprocess.TimeoutExpired:
            if not _writing(proc, pid):
                return
            if time.monotonic() >= last:
                logger.warning("%s still writes its step trace %g s past the shutdown's grace: stopped",
                               f"worker {pid}" if pid else f"a worker of engine core {proc.pid}", TRACE_WRITE_WAIT_S)
                return
        deadline = time.monotonic() + 0.05
