"""Everything a GPU session should measure, in ONE device call: ``python3 -m asyncllm.bench.gpu_session``.

Steps, in order, each a subprocess with its own time limit, all inside one
overall budget (a device command may run 10 minutes; the default budget
leaves a margin): the kernel tests (``gpu``-marked ones included), the engines' GPU tests
(``gpu-engine-tests``), the quantized weights' (``gpu-tests-quant``), the kernel micro-benchmarks,
the standard workloads, then the same workloads again with ``--compare hf`` in
steps of their own (the transformers peer is slow: a peer that overruns must
never cost our own numbers). A step that would not fit is skipped and recorded
as such; a peer step starts only when its whole limit fits. Everything lands in
``--out`` (default ``$OUT``) as three files, within the device tool's 8-file limit:

- ``session.log``: every step's output, written as it comes (a device call
  killed mid-step keeps it); the peer's phase lines (``[hf peer ...]``) are also
  echoed to this module's stdout, so the device tool's output tail shows them;
- ``results.json``: per step its command, exit code, seconds, and the JSON the workload wrote;
- ``tests.log``: pytest's report of the GPU tests (``<step>.log`` for the other pytest steps).

The device image has torch, triton and transformers but not every dependency
of asyncllm: carry wheels of msgspec, pyzmq and pytest-asyncio, and of the
transformers the CPU tests use (with its huggingface_hub and tokenizers: the
image's older transformers gives other logits for some architectures), see
docs/benchmarks.md; install them, install asyncllm (``pip install --no-deps
--no-build-isolation -e .``), then run this module.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["Step", "STEPS", "main"]


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    """asyncllm bench arguments, or a full command when ``pytest`` is set."""
    timeout_s: int
    pytest: bool = False
    min_s: int = 30
    """Skipped when less than this is left of the budget (a peer step: its whole limit)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables of the step's process."""


_QWEN = ["--preset", "qwen3-0.6b"]
_LLAMA = ["--preset", "llama3.1-8b"]
# The throughput peer gets one full static batch (64 requests): each batch runs to its longest request
# (~970 tokens) at transformers' host-bound ~85 ms per step on an H100, so 8 requests take as long as 64
# and would make the static peer 8x slower than it is on the full workload.
_HF_THROUGHPUT = ["--compare", "hf", "--compare-num-requests", "64", "--compare-time-budget", "180"]
_HF_LATENCY = ["--compare", "hf", "--compare-time-budget", "120"]
STEPS: list[Step] = [
    # every kernel test (the small shapes run on the GPU too) and the gpu-marked real-shape tests, 8 processes
    Step("gpu-tests", ["-q", "-p", "no:cacheprovider", "-n", "8", "tests/kernels", "tests/unit/test_token_feedback.py",
                       "tests/unit/test_block_table.py"], 150, pytest=True),
    # the engines' greedy parity with transformers on the GPU and sleep mode: a process per file (loadfile), since
    # the sleep test reads the device's free memory
    Step("gpu-engine-tests", ["-q", "-p", "no:cacheprovider", "-n", "2", "tests/engine/test_gpu_parity.py",
                              "tests/engine/test_sleep_mode_gpu.py", "tests/engine/test_gpu_graph_capture_families.py"],
         150, pytest=True),
    # the gpu-marked tests of quantized weights (online fp8, AWQ / GPTQ and compressed-tensors checkpoints, W8A8
    # int8), not in the folders above
    Step("gpu-tests-quant", ["-q", "-p", "no:cacheprovider", "-n", "1", "-m", "gpu", "tests/unit/test_quantization.py",
                             "tests/engine/test_quantization_engine.py", "tests/engine/test_int4_checkpoint_engine.py",
                             "tests/unit/test_compressed_tensors.py", "tests/unit/test_int8.py"],
         150, pytest=True),
    # the decode step's kernels (each launched with PDL on a Hopper GPU, kernels/_pdl.py), in and out of CUDA graphs,
    # and the engines' greedy parity: what a change to the decode path must pass before it is measured
    Step("gpu-tests-decode-path", ["-q", "-p", "no:cacheprovider", "-n", "4", *(f"tests/kernels/test_{name}.py" for name in (
        "decode_linear_kernel", "paged_decode_kernel", "paged_attention_kernel", "rotary_kv_kernel", "rms_norm_kernel",
        "silu_and_mul_kernel", "kv_write_kernel", "cuda_graph_padding", "gpu_bf16_model", "triton_backend")),
        "tests/engine/test_gpu_parity.py", "tests/engine/test_gpu_graph_capture_families.py"], 240, pytest=True),
    Step("kernels", ["kernels"], 60),
    # the unified paged-attention kernel's launch configurations on throughput-like decode batches (a rule to pick)
    Step("attention-sweep", ["attention-sweep"], 120),
    Step("throughput-qwen3", ["throughput", *_QWEN], 100),
    Step("throughput-qwen3-sync", ["throughput", *_QWEN, "--no-async-scheduling"], 100),
    Step("latency-qwen3", ["latency", *_QWEN], 60),
    Step("latency-qwen3-sync", ["latency", *_QWEN, "--no-async-scheduling"], 60),
    Step("latency-qwen3-eager", ["latency", *_QWEN, "--enforce-eager"], 60),
    # where a decode step's time goes (host phases, device kernels by kind): the note of a missed target cites it
    Step("profile-qwen3-b1", ["profile", *_QWEN, "--batch-size", "1"], 90),
    Step("profile-qwen3-b256", ["profile", *_QWEN, "--batch-size", "256"], 120),
    # the fused decode products off (docs/kernels.md: on by default): the steps above without them
    Step("latency-qwen3-unfused", ["latency", *_QWEN], 60, env=(("ASYNCLLM_DECODE_LINEAR", "0"),)),
    Step("profile-qwen3-b1-unfused", ["profile", *_QWEN, "--batch-size", "1"], 90,
         env=(("ASYNCLLM_DECODE_LINEAR", "0"),)),
    # programmatic dependent launch off (kernels/_pdl.py: on by default on Hopper): its share of the batch-1 token
    Step("latency-qwen3-nopdl", ["latency", *_QWEN], 60, env=(("ASYNCLLM_PDL", "0"),)),
    Step("profile-qwen3-b1-nopdl", ["profile", *_QWEN, "--batch-size", "1"], 90, env=(("ASYNCLLM_PDL", "0"),)),
    Step("latency-qwen3-nogreedy", ["latency", *_QWEN], 60, env=(("ASYNCLLM_GREEDY_GRAPHS", "0"),)),
    Step("profile-qwen3-b1-nogreedy", ["profile", *_QWEN, "--batch-size", "1"], 90,
         env=(("ASYNCLLM_GREEDY_GRAPHS", "0"),)),
    # the real engine's device timeline at batch 1: each worker's torch.profiler over decode steps 64-127 (the warm-up
    # takes about 5), its summary (per step host phases, device busy and idle, the largest gaps and where) in the JSON
    Step("latency-qwen3-trace", ["latency", *_QWEN, "--num-iters", "1", "--worker-trace", "64:64"], 60),
    # the workers' pipelined steps off (docs/scheduling.md, "Deferred sampled ids"): their share of the gain
    Step("latency-qwen3-nopipe", ["latency", *_QWEN], 60, env=(("ASYNCLLM_WORKER_PIPELINE", "0"),)),
    Step("throughput-qwen3-nopipe", ["throughput", *_QWEN], 100, env=(("ASYNCLLM_WORKER_PIPELINE", "0"),)),
    Step("latency-llama8b", ["latency", *_LLAMA, "--num-iters", "2"], 100),
    # fp8 weights (torch._scaled_mm) and the fp8 KV cache, against latency-qwen3 / throughput-qwen3
    Step("latency-qwen3-fp8w", ["latency", *_QWEN, "--quantization", "fp8"], 60),
    Step("throughput-qwen3-fp8kv", ["throughput", *_QWEN, "--kv-cache-dtype", "fp8"], 100),
    # the mixture of experts (fused_moe kernel; 61 GB of bf16 weights: no peer fits beside it)
    Step("latency-qwen3moe", ["latency", "--preset", "qwen3-30b-a3b", "--num-iters", "2"], 150),
    Step("throughput-qwen3moe", ["throughput", "--preset", "qwen3-30b-a3b"], 200),
    # online fp8 with the experts quantized too (session 32): against the two bf16 steps above
    Step("latency-qwen3moe-fp8", ["latency", "--preset", "qwen3-30b-a3b", "--num-iters", "2", "--quantization", "fp8"],
         150),
    Step("throughput-qwen3moe-fp8", ["throughput", "--preset", "qwen3-30b-a3b", "--quantization", "fp8"], 200),
    # gpt-oss (sinks, windows, expert biases and the clamped SwiGLU; MXFP4 experts packed, 14 GB; no peer beside it):
    # fewer requests than the standard workloads, so both fit one call with the engine's two starts
    Step("latency-gptoss20b", ["latency", "--preset", "gpt-oss-20b", "--num-iters", "2"], 150),
    Step("throughput-gptoss20b", ["throughput", "--preset", "gpt-oss-20b", "--num-requests", "128"], 200),
    Step("serve-qwen3-rate4", ["serve", *_QWEN, "--request-rate", "4", "--num-requests", "64"], 60),
    Step("serve-qwen3-rate16", ["serve", *_QWEN, "--request-rate", "16", "--num-requests", "128"], 60),
    Step("serve-qwen3-rate64", ["serve", *_QWEN, "--request-rate", "64", "--num-requests", "256"], 60),
    Step("loop-lag-qwen3", ["loop-lag", *_QWEN], 60),
    # the peer steps: our run again (~60 s with the engine's start), then the peer inside its budget
    Step("throughput-qwen3-hf", ["throughput", *_QWEN, *_HF_THROUGHPUT], 260, min_s=260),
    Step("latency-qwen3-hf", ["latency", *_QWEN, *_HF_LATENCY], 200, min_s=200),
    Step("latency-llama8b-hf", ["latency", *_LLAMA, "--num-iters", "2", *_HF_LATENCY], 240, min_s=240),
]


def _command(step: Step, json_path: str) -> list[str]:
    if step.pytest:
        return [sys.executable, "-m", "pytest", *step.argv]
    return [sys.executable, "-m", "asyncllm", "bench", *step.argv, "--no-progress", "--output-json", json_path]


def _tee(stream: IO[str], log: IO[str], lines: list[str], step: str) -> None:
    """Every line to the log at once (flushed), the peer's phase lines to stdout too."""
    for line in stream:
        lines.append(line)
        log.write(line)
        log.flush()
        if line.startswith("[hf peer"):
            print(f"[{step}] {line}", end="", flush=True)


def _run_step(step: Step, timeout: float, log: IO[str]) -> dict[str, Any]:
    json_path = os.path.join(tempfile.mkdtemp(), f"{step.name}.json")
    cmd = _command(step, json_path)
    log.write(f"\n===== {step.name}: {' '.join(cmd)} (limit {timeout:.0f}s)\n")
    log.flush()
    start = time.perf_counter()
    # the device has no network: offline, the hub is never waited on (transformers' flash-attention kernel lookup)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **dict(step.env)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=_tee, args=(proc.stdout, log, lines, step.name), daemon=True)
    reader.start()
    try:
        code: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the step's own session: the bench process and its engine
        proc.wait()
        code = "timeout"
    reader.join(timeout=10)
    output = "".join(lines)
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
    unknown = sorted(set(args.only or ()) - {s.name for s in STEPS})
    if unknown:  # a typo must not spend a device call running nothing
        parser.error(f"unknown step(s) {', '.join(unknown)}; the steps: {', '.join(s.name for s in STEPS)}")
    os.makedirs(args.out, exist_ok=True)
    steps = [s for s in STEPS if not args.only or s.name in args.only]
    results: dict[str, Any] = {}
    deadline = time.perf_counter() + args.budget_s
    with open(os.path.join(args.out, "session.log"), "w") as log:
        for step in steps:
            left = deadline - time.perf_counter()
            if left < min(step.timeout_s, step.min_s):
                results[step.name] = {"exit": "skipped", "why": f"{left:.0f}s left of the budget"}
                continue
            results[step.name] = _run_step(step, min(step.timeout_s, left), log)
            print(f"[gpu_session] {step.name}: exit {results[step.name]['exit']} "
                  f"in {results[step.name]['seconds']:.0f}s", flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
    for name, result in results.items():  # each pytest step's report: tests.log (gpu-tests), <step>.log
        if "output" in result:
            with open(os.path.join(args.out, "tests.log" if name == "gpu-tests" else f"{name}.log"), "w") as f:
                f.write(result.pop("output"))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
