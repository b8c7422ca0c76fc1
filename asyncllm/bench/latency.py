"""latency: one request at a time, 128 prompt tokens and 512 output tokens; decode tokens/s and TTFT.

Each iteration streams one request (ignoring EOS); TTFT is submission to the
first token, decode tokens/s the tokens after the first over the time after
it, ms per output token that time over the tokens after the first. Each is the
median over ``--num-iters`` iterations. With ``--output-len 1`` there is no
decode to time: TTFT is reported (the prefill latency), the decode metrics are
null (``n/a``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from asyncllm.bench import common, worker_trace
from asyncllm.bench.peer_clock import seconds
from asyncllm.bench.report import progress
from asyncllm.bench.requests import BenchRequest, fixed_requests, longest_request

__all__ = ["add_args", "run", "COMPARE_TIME_BUDGET_S"]

COMPARE_TIME_BUDGET_S = 120.0
"""The peer's default budget: transformers decodes about 12 tokens/s at batch 1 on an H100 (host-bound),
so 512 tokens take about 45 s, plus the model build and the warm-up."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=common.positive_int, default=128)
    parser.add_argument("--output-len", type=common.positive_int, default=512)
    parser.add_argument("--num-iters", type=common.positive_int, default=3, help="requests run one after another; medians reported")
    parser.add_argument("--compare", choices=("hf",), default=None, help="also run transformers' batch-1 generate")
    parser.add_argument("--compare-time-budget", type=seconds, default=None, metavar="SECONDS",
                        help=f"the peer's time limit (default {COMPARE_TIME_BUDGET_S:.0f}); a decode it cuts is "
                             "measured over the tokens generated")
    worker_trace.add_args(parser)


async def _one(engine: Any, request: BenchRequest) -> tuple[float, float, int]:
    """(TTFT, seconds after the first token, tokens) of one streamed request."""
    from asyncllm import SamplingParams

    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async for delta in engine.stream(request.prompt_token_ids, params):
        now = time.perf_counter()
        if delta.token_ids and tokens == 0:
            first = now
        tokens += len(delta.token_ids)
        last = now
    return first - start, last - first, tokens


async def run_engine(ctx: common.BenchContext, requests: list[BenchRequest]) -> dict[str, Any]:
    async with common.open_engine(ctx, longest_request(requests)) as engine:
        bar = progress(len(requests), "asyncllm latency", ctx.show_progress)
        runs = []
        for request in requests:
            runs.append(await _one(engine, request))
            bar.update(1)
        bar.close()
    return _metrics(runs, requests[0].output_len)


def _metrics(runs: list[tuple[float, float, int]], output_len: int) -> dict[str, Any]:
    """The medians over the iterations' (TTFT, seconds after the first token, tokens); an iteration with no decode
    to time (one token, or all of them in one delta) has null decode metrics, and so do the medians if none has."""
    if any(tokens != output_len for _, _, tokens in runs):
        raise RuntimeError(f"a request generated {[t for _, _, t in runs]} tokens, not {output_len}")
    ttfts = [ttft for ttft, _, _ in runs]
    decodes = [(tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None for _, decode_s, tokens in runs]
    rates = [rate for rate in decodes if rate is not None]
    return {
        "ttft_s": statistics.median(ttfts),
        "decode_tokens_per_s": statistics.median(rates) if rates else None,
        "ms_per_output_token": statistics.median([1000.0 / rate for rate in rates]) if rates else None,  # per iteration
        "ttft_s_all": ttfts,
        "decode_tokens_per_s_all": decodes,
    }


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    ctx = common.make_context(args, argv)
    requests = fixed_requests(args.num_iters, args.input_len, args.output_len, ctx.model.vocab_size, args.seed)
    common.check_fits(ctx, longest_request(requests), f"--input-len {args.input_len} + --output-len {args.output_len}")
    metrics = worker_trace.run_traced(args, lambda: asyncio.run(run_engine(ctx, requests)))
    line = common.roofline(ctx, 1, args.input_len + args.output_len / 2)
    budget = common.compare_budget(args, COMPARE_TIME_BUDGET_S)
    peers = None
    if args.compare == "hf":
        from asyncllm.bench import hf_peer

        peers = hf_peer.latency_peer(ctx, requests[0], budget)
    settings = {"input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
                "compare_time_budget_s": budget if args.compare else None, "worker_trace": args.worker_trace}
    return common.finish(ctx, "latency", settings, metrics, line, metrics["decode_tokens_per_s"],
                         peers, "decode_tokens_per_s")
