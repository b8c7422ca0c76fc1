"""The workloads' ``--worker-trace``: every worker traced by ``ASYNCLLM_WORKER_TRACE_STEPS`` (workers/step_trace.py)
over a range of its steps, each rank's summary (workers/trace_summary.py) in the metrics' ``worker_trace``."""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["add_args", "run_traced"]


def add_args(parser: argparse.ArgumentParser) -> None:
    from asyncllm.envs import WORKER_TRACE_STEPS

    def steps(text: str) -> tuple[int, int]:
        try:
            return WORKER_TRACE_STEPS.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    group = parser.add_argument_group("worker trace (docs/benchmarks.md)")
    group.add_argument("--worker-trace", type=steps, default=None, metavar="START:COUNT",
                       help="torch.profiler in every worker over its executed steps START to START+COUNT-1 (the "
                            "engine's warm-up steps count); each rank's summary goes into the metrics' worker_trace")
    group.add_argument("--worker-trace-dir", default=None, metavar="DIR",
                       help="keep the ranks' summary files here (default: a temporary folder, removed)")
    group.add_argument("--worker-trace-chrome", action="store_true",
                       help="with --worker-trace-dir: also each rank's gzipped Chrome trace (megabytes)")


def run_traced(args: argparse.Namespace, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s metrics; with ``--worker-trace``, run under the trace's variables, with the ranks' summaries under
    ``worker_trace``."""
    if args.worker_trace is None:
        return run()
    from asyncllm.errors import ConfigError

    if args.worker_trace_chrome and not args.worker_trace_dir:
        raise ConfigError("worker_trace_chrome", True, "with --worker-trace-dir (a temporary folder is removed)")
    with _trace_dir(args.worker_trace_dir) as folder, _environ(args, folder):
        metrics = run()
        summaries = _read(folder)
    metrics["worker_trace"] = summaries
    _print(summaries, args.worker_trace)
    return metrics


@contextlib.contextmanager
def _trace_dir(kept: str | None) -> Iterator[str]:
    if kept:
        os.makedirs(kept, exist_ok=True)
        yield kept
        return
    with tempfile.TemporaryDirectory(prefix="asyncllm-worker-trace-") as folder:
        yield folder


@contextlib.contextmanager
def _environ(args: argparse.Namespace, folder: str) -> Iterator[None]:
    """The trace's variables for the engine this process starts (its core and workers inherit them)."""
    from asyncllm import envs

    start, count = args.worker_trace
    values = {envs.WORKER_TRACE_STEPS.name: f"{start}:{count}", envs.WORKER_TRACE_DIR.name: folder,
              envs.WORKER_TRACE_CHROME.name: "1" if args.worker_trace_chrome else "0"}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _read(folder: str) -> list[dict[str, Any]]:
    summaries = []
    for path in glob.glob(os.path.join(folder, "worker-trace-rank*.json")):
        with open(path) as f:
            summaries.append(json.load(f))
    return sorted(summaries, key=lambda s: (s.get("rank", 0), s.get("pid", 0)))


def _print(summaries: list[dict[str, Any]], steps: tuple[int, int]) -> None:
    if not summaries:
        print(f"[worker trace] no worker wrote a trace of steps {steps[0]}:{steps[1]}", flush=True)
    for s in summaries:
        if not s.get("num_steps"):
            print(f"[worker trace] rank {s.get('rank')}: nothing traced ({s.get('note', '')})", flush=True)
            continue
        m = {k: "n/a" if v is None else f"{v:.3f}" for k, v in s["mean"].items() if not isinstance(v, dict)}
        top = s["top_gaps"][0] if s["top_gaps"] else None
        largest = (f"; largest gap {top['ms']:.3f} ms after {top['after'][:60]} (host in {top['host_at_start']})"
                   if top else "")
        print(f"[worker trace] rank {s['rank']}: {s['num_steps']} steps from {s['first_step']}, per step (mean) "
              f"{m['wall_ms']} ms wall, device busy {m['device_busy_ms']} ms, idle {m['device_idle_ms']} ms "
              f"({m['idle_between_ms']} between steps){largest}", flush=True)
