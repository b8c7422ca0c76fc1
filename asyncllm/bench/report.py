"""What every benchmark run prints and saves: metadata, a summary table, the JSON file."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from typing import Any, Iterable

import torch

__all__ = ["percentile", "run_metadata", "device_name", "print_summary", "write_json", "progress"]


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    data = sorted(values)
    if not data:
        return 0.0
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def device_name() -> str:
    """The GPU's name, or the CPU's model and core count."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"CPU: {model} ({os.cpu_count()} cores)"


def _commit() -> str:
    """The git commit of the asyncllm source tree, if it is a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run_metadata(argv: list[str] | None) -> dict[str, Any]:
    import transformers

    from asyncllm import __version__

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "commit": _commit(),
        "command": "asyncllm bench " + " ".join(sys.argv[2:] if argv is None else argv),
        "asyncllm": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _fmt(value: Any) -> str:
    if value is None:  # JSON null: not measurable in this run
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_summary(title: str, rows: list[tuple[str, Any]], file: Any = None) -> None:
    """A two-column table: metric, value."""
    file = file or sys.stdout
    width = max([len(name) for name, _ in rows] + [len(title)])
    rule = "=" * (width + 20)
    print(rule, file=file)
    print(title, file=file)
    print("-" * (width + 20), file=file)
    for name, value in rows:
        print(f"{name:<{width}}  {_fmt(value):>16}", file=file)
    print(rule, file=file, flush=True)


def write_json(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=False)
        f.write("\n")


def progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (disabled: a no-op bar with the same methods)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr, dynamic_ncols=True)
