"""soak: thousands of concurrent streams for minutes, with random cancellations and timeouts; nothing may leak.

``--num-streams`` (2,000) client slots each run requests back to back for
``--duration`` seconds (600). Each request draws its fate: run to the end,
be cancelled by its client after a random number of tokens (``break``), carry
a per-request ``timeout`` (finish_reason "timeout"), or be cut by the
client's own ``asyncio.wait_for``. At the end the run checks that every
request finished or was aborted (no other error, none hung), that the KV
cache is empty and nothing runs or waits, and that resident memory (host,
engine core, workers, read from /proc) stayed flat from the end of the
warm-up to the end. A probe task samples the host event loop's lag
throughout (a reservoir of samples, so the probe itself does not grow).
Scale down with ``--num-streams 300 --duration 60``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from asyncllm.bench import common
from asyncllm.bench.report import percentile
from asyncllm.procutil import proc_stat

__all__ = ["add_args", "run"]

_PROBE_S = 0.001
_RESERVOIR = 20_000
_FATES = ("finish", "cancel", "timeout", "client_timeout")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-streams", type=int, default=2000, help="concurrent client slots (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: %(default)s)")
    parser.add_argument("--input-len", type=common.int_range, default=(4, 64), help="prompt length range LO,HI")
    parser.add_argument("--output-len", type=common.int_range, default=(4, 128), help="max_tokens range LO,HI")
    parser.add_argument("--cancel-fraction", type=float, default=0.2, help="requests their client leaves early")
    parser.add_argument("--timeout-fraction", type=float, default=0.1, help="requests with a short per-request timeout")
    parser.add_argument("--client-timeout-fraction", type=float, default=0.1,
                        help="requests cut by the client's asyncio.wait_for")
    parser.add_argument("--warmup-fraction", type=float, default=0.1,
                        help="share of the duration before the starting memory sample (default: %(default)s)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="KV blocks (num_gpu_blocks_override; default: sized from memory). The prefix cache keeps "
                             "a hash and the tokens of every block it has filled, so the core's memory grows until "
                             "every block was used once: a smaller cache reaches that plateau within the warm-up")
    parser.add_argument("--max-rss-growth", type=float, default=0.25,
                        help="fail if any process's RSS grew by more than this fraction (and 64 MiB) after warm-up")


@dataclass
class _Tally:
    outcomes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in (*_FATES, "error")})
    output_tokens: int = 0
    errors: list[str] = field(default_factory=list)


class _LagProbe:
    """Event-loop lag samples (1 ms sleeps), kept in a fixed-size reservoir."""

    def __init__(self, seed: int) -> None:
        self.samples: list[float] = []
        self.count = 0
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(_PROBE_S)
            self._add(time.perf_counter() - start - _PROBE_S)

    def _add(self, lag: float) -> None:
        self.count += 1
        if len(self.samples) < _RESERVOIR:
            self.samples.append(lag)
        else:
            slot = self._rng.randrange(self.count)
            if slot < _RESERVOIR:
                self.samples[slot] = lag

    def stop(self) -> None:
        self._stop.set()


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _worker_pids(core_pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields is None or int(fields[1]) != core_pid:
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"asyncllm.workers.worker" in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return sorted(pids)


def _rss_sample(engine: Any) -> dict[str, float]:
    core_pid = engine._core.pid
    sample = {"host": _rss_mib(os.getpid()), "core": _rss_mib(core_pid)}
    for rank, pid in enumerate(_worker_pids(core_pid)):
        sample[f"worker{rank}"] = _rss_mib(pid)
    return sample


async def _one_request(engine: Any, args: argparse.Namespace, rng: random.Random, tally: _Tally) -> None:
    from asyncllm import SamplingParams

    prompt = [rng.randrange(10, args.vocab_size) for _ in range(rng.randint(*args.input_len))]
    max_tokens = rng.randint(*args.output_len)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=rng.randrange(2**31))
    draw = rng.random()
    edges = (args.cancel_fraction, args.cancel_fraction + args.timeout_fraction,
             args.cancel_fraction + args.timeout_fraction + args.client_timeout_fraction)
    fate = "cancel" if draw < edges[0] else "timeout" if draw < edges[1] else \
        "client_timeout" if draw < edges[2] else "finish"
    timeout = rng.uniform(0.05, 2.0) if fate == "timeout" else None
    stop_after = rng.randint(1, max_tokens) if fate == "cancel" else None

    async def consume() -> str:
        tokens = 0
        async for delta in engine.stream(prompt, params, timeout=timeout):
            tokens += len(delta.token_ids)
            tally.output_tokens += len(delta.token_ids)
            if stop_after is not None and tokens >= stop_after:
                return "cancel"  # leaving the loop aborts the request
            if delta.finish_reason is not None:
                return "timeout" if delta.finish_reason == "timeout" else "finish"
        raise AssertionError("the stream ended without a finish_reason")

    try:
        if fate == "client_timeout":
            try:
                outcome = await asyncio.wait_for(consume(), rng.uniform(0.05, 2.0))
            except TimeoutError:
                outcome = "client_timeout"
        else:
            outcome = await consume()
    except Exception as exc:  # noqa: BLE001 - counted and reported: the soak fails on any
        outcome = "error"
        if len(tally.errors) < 10:
            tally.errors.append(f"{type(exc).__name__}: {exc}")
    tally.outcomes[outcome] += 1


async def _slot(engine: Any, args: argparse.Namespace, seed: int, stop_at: float, tally: _Tally) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, 1.0))  # spread the first arrivals
    while time.monotonic() < stop_at:
        await _one_request(engine, args, rng, tally)


async def _sample_memory(engine: Any, args: argparse.Namespace, t0: float, samples: list[tuple[float, dict]]) -> None:
    interval = max(1.0, args.duration / 60)
    while True:
        samples.append((time.monotonic() - t0, _rss_sample(engine)))
        await asyncio.sleep(interval)


async def _wait_idle(engine: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_requests_running == 0 and s.num_requests_waiting == 0 and s.num_used_blocks == 0:
            return s
        await asyncio.sleep(0.05)
    return engine.stats()


async def run_engine(ctx: common.BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    from asyncllm import AsyncEngine

    kwargs = common.engine_kwargs(ctx, args.input_len[1] + args.output_len[1])
    if args.num_gpu_blocks is not None:
        kwargs["num_gpu_blocks_override"] = args.num_gpu_blocks
    async with AsyncEngine(ctx.model.path, **kwargs) as engine:  # the warm-up is the first part of the load
        tally, memory = _Tally(), []
        probe = _LagProbe(args.seed)
        probe_task = asyncio.create_task(probe.run())
        t0 = time.monotonic()
        sampler = asyncio.create_task(_sample_memory(engine, args, t0, memory))
        slots = [_slot(engine, args, args.seed * 1_000_003 + i, t0 + args.duration, tally)
                 for i in range(args.num_streams)]
        await asyncio.gather(*slots)
        elapsed = time.monotonic() - t0
        idle = await _wait_idle(engine)
        memory.append((time.monotonic() - t0, _rss_sample(engine)))
        sampler.cancel()
        probe.stop()
        await probe_task
    return _metrics(args, tally, memory, probe, idle, elapsed)


def _metrics(args: argparse.Namespace, tally: _Tally, memory: list[tuple[float, dict]], probe: _LagProbe,
             idle: Any, elapsed: float) -> dict[str, Any]:
    warm = [m for t, m in memory if t >= args.warmup_fraction * args.duration] or [memory[-1][1]]
    start, end = warm[0], memory[-1][1]
    metrics: dict[str, Any] = {
        "num_requests": sum(tally.outcomes.values()),
        **{f"num_{k}": v for k, v in tally.outcomes.items()},
        "output_tokens_per_s": tally.output_tokens / elapsed,
        "kv_blocks_in_use_after": idle.num_used_blocks,
        "num_preemptions": idle.num_preemptions_total,
        "requests_left_after": idle.num_requests_running + idle.num_requests_waiting,
        "loop_lag_p50_ms": 1000 * percentile(probe.samples, 50),
        "loop_lag_p99_ms": 1000 * percentile(probe.samples, 99),
        "loop_lag_max_ms": 1000 * max(probe.samples, default=0.0),
    }
    for name in end:
        metrics[f"rss_{name}_start_mib"] = start.get(name, 0.0)
        metrics[f"rss_{name}_end_mib"] = end[name]
    metrics["rss_samples"] = [{"t": round(t, 1), **m} for t, m in memory]
    metrics["errors"] = tally.errors
    return metrics


def _problems(args: argparse.Namespace, metrics: dict[str, Any]) -> list[str]:
    problems = []
    if metrics["num_error"]:
        problems.append(f"{metrics['num_error']} requests failed: {metrics['errors']}")
    if metrics["kv_blocks_in_use_after"] or metrics["requests_left_after"]:
        problems.append(f"after the load: {metrics['kv_blocks_in_use_after']} KV blocks in use, "
                        f"{metrics['requests_left_after']} requests left")
    for key, value in metrics.items():
        if key.endswith("_end_mib"):
            begin = metrics[key.replace("_end_", "_start_")]
            if value - begin > max(args.max_rss_growth * begin, 64.0):
                problems.append(f"{key[4:-8]} RSS grew from {begin:.0f} to {value:.0f} MiB")
    return problems


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    ctx = common.make_context(args, argv)
    common.check_fits(ctx, args.input_len[1] + args.output_len[1], "--input-len {},{} + --output-len {},{}".format(
        *args.input_len, *args.output_len))
    args.vocab_size = ctx.model.vocab_size
    metrics = asyncio.run(run_engine(ctx, args))
    mean_context = sum(args.input_len) / 2 + sum(args.output_len) / 4
    line = common.roofline(ctx, min(args.num_streams, common.max_num_seqs(args)), mean_context)
    settings = {k: getattr(args, k) for k in ("num_streams", "duration", "input_len", "output_len", "cancel_fraction",
                                              "timeout_fraction", "client_timeout_fraction", "num_gpu_blocks")}
    result = common.finish(ctx, "soak", settings, metrics, line, metrics["output_tokens_per_s"])
    problems = _problems(args, metrics)
    if problems:
        print("[soak] FAILED: " + "; ".join(problems), file=sys.stderr, flush=True)
        raise SystemExit(1)
    print(f"[soak] passed: {metrics['num_requests']} requests, every one finished or aborted; KV cache empty; "
          "memory flat", flush=True)
    return result
