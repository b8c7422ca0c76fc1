"""Everything a GPU session should measure, in ONE device call: ``python3 -m asyncllm.bench.gpu_session``.

Steps, in order, each a subprocess with its own time limit, all inside one
overall budget (a device command may run 10 minutes; the default budget
leaves a margin): the kernel tests (``gpu``-marked ones included), the kernel micro-benchmarks, then
the standard workloads with ``--compare hf`` (the transformers peer on a
subset of the throughput requests, to fit the budget). A step that would not
fit is skipped and recorded as such. Everything lands in ``--out`` (default
``$OUT``) as three files, within the device tool's 8-file limit:

- ``session.log``: every step's output;
- ``results.json``: per step its command, exit code, seconds, and the JSON the workload wrote;
- ``tests.log``: pytest's report of the GPU tests.

The device image has torch, triton and transformers but not every dependency
of asyncllm: carry wheels of msgspec, pyzmq and pytest-asyncio (see
docs/benchmarks.md), install them, install asyncllm (``pip install --no-deps
--no-build-isolation -e .``), then run this module.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Step", "STEPS", "main"]


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    """asyncllm bench arguments, or a full command when ``pytest`` is set."""
    timeout_s: int
    pytest: bool = False


_QWEN = ["--preset", "qwen3-0.6b"]
_LLAMA = ["--preset", "llama3.1-8b"]
STEPS: list[Step] = [
    # every kernel test (the small shapes run on the GPU too) and the gpu-marked real-shape and parity tests
    Step("gpu-tests", ["-q", "-p", "no:cacheprovider", "tests/kernels", "tests/engine/test_gpu_parity.py"],
         170, pytest=True),
    Step("kernels", ["kernels"], 60),
    # the transformers peer did not finish 16 or 32 requests within 200 s on an H100 (2026-11-22)
    Step("throughput-qwen3", ["throughput", *_QWEN, "--compare", "hf", "--compare-num-requests", "8"], 280),
    Step("throughput-qwen3-async", ["throughput", *_QWEN, "--async-scheduling"], 100),
    Step("latency-qwen3", ["latency", *_QWEN, "--compare", "hf"], 150),
    Step("latency-qwen3-async", ["latency", *_QWEN, "--async-scheduling"], 60),
    Step("latency-qwen3-eager", ["latency", *_QWEN, "--enforce-eager"], 60),
    Step("latency-llama8b", ["latency", *_LLAMA, "--compare", "hf", "--num-iters", "2"], 150),
    Step("serve-qwen3-rate4", ["serve", *_QWEN, "--request-rate", "4", "--num-requests", "64"], 60),
    Step("serve-qwen3-rate16", ["serve", *_QWEN, "--request-rate", "16", "--num-requests", "128"], 60),
    Step("serve-qwen3-rate64", ["serve", *_QWEN, "--request-rate", "64", "--num-requests", "256"], 60),
    Step("loop-lag-qwen3", ["loop-lag", *_QWEN], 60),
]


def _run_step(step: Step, timeout: float, log: Any) -> dict[str, Any]:
    json_path = os.path.join(tempfile.mkdtemp(), f"{step.name}.json")
    if step.pytest:
        cmd = [sys.executable, "-m", "pytest", *step.argv]
    else:
        cmd = [sys.executable, "-m", "asyncllm", "bench", *step.argv, "--no-progress", "--output-json", json_path]
    log.write(f"\n===== {step.name}: {' '.join(cmd)} (limit {timeout:.0f}s)\n")
    log.flush()
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        output, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), "timeout"
    log.write(output)
    log.flush()
    result: dict[str, Any] = {"command": " ".join(cmd), "exit": code, "seconds": time.perf_counter() - start}
    if os.path.exists(json_path):
        with open(json_path) as f:
            result["result"] = json.load(f)
    if step.pytest:
        result["summary"] = output.strip().splitlines()[-1] if output.strip() else ""
        result["output"] = output
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m asyncllm.bench.gpu_session", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-session-out"))
    parser.add_argument("--budget-s", type=float, default=560.0, help="stop starting steps past this many seconds")
    parser.add_argument("--only", action="append", help="run only these steps (repeatable): " +
                        ", ".join(s.name for s in STEPS))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    steps = [s for s in STEPS if not args.only or s.name in args.only]
    results: dict[str, Any] = {}
    deadline = time.perf_counter() + args.budget_s
    with open(os.path.join(args.out, "session.log"), "w") as log:
        for step in steps:
            left = deadline - time.perf_counter()
            if left < min(step.timeout_s, 30):
                results[step.name] = {"exit": "skipped", "why": f"{left:.0f}s left of the budget"}
                continue
            results[step.name] = _run_step(step, min(step.timeout_s, left), log)
            print(f"[gpu_session] {step.name}: exit {results[step.name]['exit']} "
                  f"in {results[step.name]['seconds']:.0f}s", flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
    if "output" in results.get("gpu-tests", {}):
        with open(os.path.join(args.out, "tests.log"), "w") as f:
            f.write(results["gpu-tests"].pop("output"))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
