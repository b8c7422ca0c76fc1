"""loop-lag: how much the engine delays the host's event loop while it streams.

``--num-streams`` concurrent streams (256) are consumed in one event loop
while a probe task sleeps 1 ms in a loop; each wake-up's delay past its 1 ms
is one lag sample. asyncllm keeps CPU work (tokenizing, detokenizing, socket
I/O) on its processor thread, so the loop should stay responsive.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from asyncllm.bench import common
from asyncllm.bench.report import percentile, progress
from asyncllm.bench.requests import BenchRequest, check_output_tokens, fixed_requests, longest_request

__all__ = ["add_args", "run"]

_PROBE_S = 0.001


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-streams", type=common.positive_int, default=256)
    parser.add_argument("--input-len", type=common.positive_int, default=128)
    parser.add_argument("--output-len", type=common.positive_int, default=256)


async def _probe(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(_PROBE_S)
        lags.append(time.perf_counter() - start - _PROBE_S)


async def _consume(engine: Any, request: BenchRequest) -> int:
    from asyncllm import SamplingParams

    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)
    tokens = 0
    async for delta in engine.stream(request.prompt_token_ids, params):
        tokens += len(delta.token_ids)
    return tokens


async def run_engine(ctx: common.BenchContext, requests: list[BenchRequest]) -> dict[str, Any]:
    async with common.open_engine(ctx, longest_request(requests)) as engine:
        idle: list[float] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(_probe(idle, stop))
        await asyncio.sleep(0.2)  # the loop's own lag with the engine idle, for reference
        idle_count = len(idle)
        bar = progress(len(requests), "asyncllm streams", ctx.show_progress)

        async def one(request: BenchRequest) -> int:
            tokens = await _consume(engine, request)
            bar.update(1)
            return tokens

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(r) for r in requests))
        elapsed = time.perf_counter() - start
        stop.set()
        await probe
        bar.close()
    check_output_tokens(requests, sum(tokens))
    lags = idle[idle_count:]
    return {
        "num_streams": len(requests),
        "output_tokens_per_s": sum(tokens) / elapsed,
        "lag_p50_ms": 1000 * percentile(lags, 50),
        "lag_p99_ms": 1000 * percentile(lags, 99),
        "lag_max_ms": 1000 * max(lags, default=0.0),
        "idle_lag_p50_ms": 1000 * percentile(idle[:idle_count], 50),
        "num_lag_samples": len(lags),
    }


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    ctx = common.make_context(args, argv)
    requests = fixed_requests(args.num_streams, args.input_len, args.output_len, ctx.model.vocab_size, args.seed)
    common.check_fits(ctx, longest_request(requests), f"--input-len {args.input_len} + --output-len {args.output_len}")
    metrics = asyncio.run(run_engine(ctx, requests))
    line = common.roofline(ctx, min(args.num_streams, common.max_num_seqs(args)), args.input_len + args.output_len / 2)
    settings = {"num_streams": args.num_streams, "input_len": args.input_len, "output_len": args.output_len}
    return common.finish(ctx, "loop-lag", settings, metrics, line, metrics["output_tokens_per_s"])
