"""Scheduler micro-benchmark: one decode step's `schedule()` + `update_from_output()`, no model.

``python -m asyncllm.bench.scheduler`` (or ``asyncllm bench scheduler``)
admits `num_requests` requests, runs their prefills, then times `steps`
decode steps with all of them running: the engine core's own cost per step,
which the model step must hide. Prompt lengths vary (seeded), so requests
fill KV blocks (and hash them for the prefix cache) at different steps, as in
real traffic. The fake worker's output is built outside the timed region.

`run_overlapped` times the engine core's step with ``async_scheduling`` (the
default) instead: the may-preempt check, `schedule()`, the placeholders'
advance and the commit of the step before (which takes the placeholders back,
runs `update_from_output()` and advances again).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.sampling import SamplingParams
from asyncllm.sched.placeholders import OutputPlaceholders
from asyncllm.sched.request import Request
from asyncllm.sched.scheduler import Scheduler

__all__ = ["run", "main"]

_BLOCK_SIZE = 16
_PROMPT_LENS = (16, 128)
"""Prompt lengths are drawn uniformly from this range."""


def _scheduler(num_requests: int, steps: int, enable_prefix_caching: bool) -> Scheduler:
    max_model_len = _PROMPT_LENS[1] + steps + 8
    num_gpu_blocks = num_requests * (-(-max_model_len // _BLOCK_SIZE))
    config = EngineConfig.create(
        "bench-model", block_size=_BLOCK_SIZE, max_num_seqs=num_requests, max_num_batched_tokens=1 << 20,
        max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
    )
    return Scheduler(config, num_gpu_blocks, max_model_len)


def _runner_output(out: protocol.SchedulerOutput, sched: Scheduler) -> protocol.ModelRunnerOutput:
    """What a worker returns: one token for every request whose known tokens are all computed after the step."""
    req_ids, sampled = [], []
    requests = sched.requests
    for req_id, num in out.num_scheduled_tokens.items():
        req = requests[req_id]
        req_ids.append(req_id)
        sampled.append([7] if req.num_computed_tokens + num == req.num_tokens else [])
    return protocol.ModelRunnerOutput(out.step_id, req_ids, sampled)


def _decoding(num_requests: int, steps: int, seed: int, enable_prefix_caching: bool) -> Scheduler:
    """A scheduler with `num_requests` requests admitted and prefilled, each decoding."""
    rng = random.Random(seed)
    sched = _scheduler(num_requests, steps, enable_prefix_caching)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(*_PROMPT_LENS))]
        sched.add_request(Request(f"req-{i}", prompt, params, [2], float(i)))
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        out = sched.schedule()
        sched.update_from_output(out, _runner_output(out, sched))
    assert len(sched.running) == num_requests, "every request must be decoding"
    return sched


def run(num_requests: int = 1024, steps: int = 200, seed: int = 0, enable_prefix_caching: bool = True) -> dict:
    """Time `steps` decode steps of `num_requests` running requests; milliseconds per step."""
    sched = _decoding(num_requests, steps, seed, enable_prefix_caching)
    schedule_s, update_s, cpu_s = [], [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the core runs with gc on, but a collection landing in one step would only add noise here
    try:
        for _ in range(steps):
            c0, t0 = time.thread_time(), time.perf_counter()
            out = sched.schedule()
            t1, c1 = time.perf_counter(), time.thread_time()
            runner_out = _runner_output(out, sched)
            c2, t2 = time.thread_time(), time.perf_counter()
            sched.update_from_output(out, runner_out)
            t3, c3 = time.perf_counter(), time.thread_time()
            assert out.total_num_scheduled_tokens == num_requests
            schedule_s.append(t1 - t0)
            update_s.append(t3 - t2)
            cpu_s.append(c1 - c0 + c3 - c2)
    finally:
        if gc_was_enabled:
            gc.enable()
    return _summary(num_requests, steps, schedule_s, update_s, cpu_s, enable_prefix_caching)


def run_overlapped(num_requests: int = 1024, steps: int = 200, seed: int = 0,
                   enable_prefix_caching: bool = True) -> dict:
    """Time `steps` overlapped core steps (one step in flight) of `num_requests` decoding requests: the median ms."""
    sched = _decoding(num_requests, steps, seed, enable_prefix_caching)
    placeholders = OutputPlaceholders(sched)
    in_flight = None
    step_s = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(steps + 1):  # the first step commits nothing: not timed
            t0 = time.perf_counter()
            assert not placeholders.may_preempt(), "the benchmark's steps never preempt"
            out = sched.schedule()
            t1 = time.perf_counter()
            runner_out = _runner_output(out, sched)  # before the advance: who samples at the end of its tokens
            t2 = time.perf_counter()
            placeholders.advance(out)
            if in_flight is not None:
                placeholders.commit(in_flight)
            t3 = time.perf_counter()
            in_flight = runner_out
            if i:
                step_s.append(t1 - t0 + t3 - t2)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {"num_requests": num_requests, "steps": len(step_s), "median_ms": statistics.median(step_s) * 1e3,
            "min_ms": min(step_s) * 1e3}


def _summary(num_requests: int, steps: int, schedule_s: list[float], update_s: list[float], cpu_s: list[float],
             prefix: bool) -> dict:
    """Wall-clock figures, and the CPU time of the same regions (what a busy machine does not inflate)."""
    total = sorted(a + b for a, b in zip(schedule_s, update_s))
    ms = 1e3
    return {
        "num_requests": num_requests,
        "steps": steps,
        "enable_prefix_caching": prefix,
        "median_ms": statistics.median(total) * ms,
        "min_ms": total[0] * ms,
        "p90_ms": total[int(0.9 * (len(total) - 1))] * ms,
        "max_ms": total[-1] * ms,
        "schedule_median_ms": statistics.median(schedule_s) * ms,
        "update_median_ms": statistics.median(update_s) * ms,
        "cpu_median_ms": statistics.median(cpu_s) * ms,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="asyncllm bench scheduler", description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    result = run(args.num_requests, args.steps, args.seed, not args.no_prefix_caching)
    overlapped = run_overlapped(args.num_requests, args.steps, args.seed, not args.no_prefix_caching)
    result["overlapped_median_ms"], result["overlapped_min_ms"] = overlapped["median_ms"], overlapped["min_ms"]
    if args.json:
        print(json.dumps(result))
        return
    print(f"scheduler: {result['num_requests']} running requests, {result['steps']} decode steps "
          f"(prefix caching {'on' if result['enable_prefix_caching'] else 'off'})")
    print(f"  schedule() + update_from_output(): median {result['median_ms']:.3f} ms, "
          f"min {result['min_ms']:.3f} ms, p90 {result['p90_ms']:.3f} ms, max {result['max_ms']:.3f} ms")
    print(f"  schedule() median {result['schedule_median_ms']:.3f} ms, "
          f"update_from_output() median {result['update_median_ms']:.3f} ms")
    print(f"  CPU time of both: median {result['cpu_median_ms']:.3f} ms")
    print(f"  overlapped core step (async_scheduling: may-preempt check, schedule(), placeholders, commit): "
          f"median {result['overlapped_median_ms']:.3f} ms, min {result['overlapped_min_ms']:.3f} ms")


if __name__ == "__main__":
    main()
