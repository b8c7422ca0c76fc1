"""serve: Poisson arrivals at ``--request-rate`` through the async API; TTFT, ITL and output tokens/s.

Requests with ShareGPT-like synthetic lengths (seeded) arrive with exponential
gaps of mean ``1 / request_rate`` (``inf``: all at once) and are streamed
concurrently. TTFT is arrival to first token; each later delta adds one
inter-token-latency sample (the gap since the previous delta: the bench
consumes promptly, so deltas carry one token each unless the engine is faster
than the event loop); with one output token per request there is none, and the
ITL percentiles are null (``n/a``). A request the engine fails is counted
(``num_failed_requests``) and left out of the other metrics, as in vLLM's
``bench serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from typing import Any

from asyncllm.bench import common
from asyncllm.bench.report import percentile, progress
from asyncllm.bench.requests import (BenchRequest, check_output_tokens, longest_request, sharegpt_like_requests,
                                    total_tokens)
from asyncllm.errors import AsyncLLMError

__all__ = ["add_args", "run"]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request-rate", type=common.positive_float, default=8.0, help="mean arrivals per second (inf: all at once)")
    parser.add_argument("--num-requests", type=common.positive_int, default=256)
    parser.add_argument("--max-input-len", type=common.positive_int, default=2048)
    parser.add_argument("--max-output-len", type=common.positive_int, default=1024)


async def _stream(engine: Any, request: BenchRequest, delay: float, t0: float) -> dict[str, Any]:
    from asyncllm import SamplingParams

    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)
    arrival = previous = time.perf_counter()
    ttft, itls, tokens = 0.0, [], 0
    try:
        async for delta in engine.stream(request.prompt_token_ids, params):
            now = time.perf_counter()
            if delta.token_ids:
                if tokens == 0:
                    ttft = now - arrival
                else:
                    itls.append(now - previous)
                previous = now
                tokens += len(delta.token_ids)
    except AsyncLLMError as exc:  # the engine failed this request: counted as failed, out of the latencies (vLLM's)
        return {"error": exc, "tokens": tokens}
    return {"ttft": ttft, "itls": itls, "tokens": tokens, "e2e": time.perf_counter() - arrival}


def _arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 2)
    delays, t = [], 0.0
    for _ in range(num):
        delays.append(t)
        t += rng.expovariate(rate)
    return delays


async def run_engine(ctx: common.BenchContext, requests: list[BenchRequest], rate: float) -> dict[str, Any]:
    delays = _arrival_delays(len(requests), rate, ctx.args.seed)
    async with common.open_engine(ctx, longest_request(requests)) as engine:
        bar = progress(len(requests), "asyncllm serve", ctx.show_progress)

        async def one(request: BenchRequest, delay: float) -> dict[str, Any]:
            result = await _stream(engine, request, delay, t0)
            bar.update(1)
            return result

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays)))
        elapsed = time.perf_counter() - t0
        bar.close()
    return _metrics(requests, results, elapsed)


def _metrics(requests: list[BenchRequest], results: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """The metrics over the requests that completed; those the engine failed are counted (``num_failed_requests``,
    their first errors in ``failed_errors``), as vLLM's ``bench serve`` does; a run where all failed raises the first
    error (one ``asyncllm bench`` line)."""
    failed = [r["error"] for r in results if "error" in r]
    if len(failed) == len(results):
        raise failed[0]
    completed = [i for i, r in enumerate(results) if "error" not in r]
    output_tokens = sum(results[i]["tokens"] for i in completed)
    check_output_tokens([requests[i] for i in completed], output_tokens)
    ttfts = [results[i]["ttft"] for i in completed]
    itls = [itl for i in completed for itl in results[i]["itls"]]
    return {
        "num_requests": len(requests),
        "num_failed_requests": len(failed),
        "failed_errors": [f"{type(exc).__name__}: {exc}" for exc in failed[:5]],
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(itls, 50) if itls else None,  # one token each: no gap to measure (n/a)
        "itl_p99_ms": 1000 * percentile(itls, 99) if itls else None,
        "mean_concurrency": sum(results[i]["e2e"] for i in completed) / elapsed,
    }


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    ctx = common.make_context(args, argv)
    requests = sharegpt_like_requests(args.num_requests, ctx.model.vocab_size, args.seed,
                                      args.max_input_len, args.max_output_len)
    common.check_fits(ctx, longest_request(requests), f"a prompt of at most --max-input-len {args.max_input_len} + "
                                                      f"an output of at most --max-output-len {args.max_output_len}")
    metrics = asyncio.run(run_engine(ctx, requests, args.request_rate))
    prompt_tokens, output_tokens = total_tokens(requests)
    batch = min(common.max_num_seqs(args), max(1, round(metrics["mean_concurrency"])))
    line = common.roofline(ctx, batch, (prompt_tokens + output_tokens / 2) / len(requests))
    settings = {"request_rate": args.request_rate, "num_requests": args.num_requests,
                "max_input_len": args.max_input_len, "max_output_len": args.max_output_len}
    return common.finish(ctx, "serve", settings, metrics, line, metrics["output_tokens_per_s"])
