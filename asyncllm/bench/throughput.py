"""throughput: many requests submitted at once (the nano-vllm workload); output and total tokens/s.

256 requests by default, input and output lengths each uniform in [100, 1024]
(seeded), every request ignoring EOS; with ``--preset tiny`` (CPU runs) 8 requests,
inputs in [8, 32] and outputs in [4, 16] by default. The clock runs from the first
submission to the last completion, after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from asyncllm.bench import common, worker_trace
from asyncllm.bench.peer_clock import seconds
from asyncllm.bench.report import progress
from asyncllm.bench.requests import (
    BenchRequest, check_output_tokens, decode_shape, longest_request, total_tokens, uniform_requests,
)

__all__ = ["add_args", "run", "COMPARE_TIME_BUDGET_S"]

COMPARE_TIME_BUDGET_S = 240.0
"""The peer's default budget: one 64-request static batch of this workload takes about 85 s on an H100
(transformers' decode step is host-bound, about 85 ms), continuous batching about as long or longer."""


GPU_WORKLOAD = {"num_requests": 256, "input_len_range": (100, 1024), "output_len_range": (100, 1024)}
"""The default workload (nano-vllm's): hours on a CPU."""
TINY_WORKLOAD = {"num_requests": 8, "input_len_range": (8, 32), "output_len_range": (4, 16)}
"""The default workload with ``--preset tiny``, the CPU preset (docs/benchmarks.md#running-on-the-cpu): seconds."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=common.positive_int, default=None,
                        help="default: 256 (8 with --preset tiny)")
    parser.add_argument("--input-len-range", type=common.int_range, default=None, metavar="LO,HI",
                        help="default: 100,1024 (8,32 with --preset tiny)")
    parser.add_argument("--output-len-range", type=common.int_range, default=None, metavar="LO,HI",
                        help="default: 100,1024 (4,16 with --preset tiny)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--compare", choices=("hf",), default=None, help="also run transformers on the same requests")
    parser.add_argument("--compare-num-requests", type=common.positive_int, default=None,
                        help="run the peer on only the first N requests; asyncllm runs them again, alone, for the "
                             "ratio; default: all")
    parser.add_argument("--compare-time-budget", type=seconds, default=None, metavar="SECONDS",
                        help=f"the whole peer side's time limit (default {COMPARE_TIME_BUDGET_S:.0f}): half of what "
                             "is left after its set-up for static batching, the rest for continuous batching; a cut "
                             "peer reports what it completed")
    parser.add_argument("--hf-batch-size", type=common.positive_int, default=64,
                        help="transformers' static batch size")
    worker_trace.add_args(parser)


async def run_engine(ctx: common.BenchContext, requests: list[BenchRequest], temperature: float,
                     num_compared: int | None = None) -> dict[str, Any]:
    """Submit every request at once; returns the measured metrics. With `num_compared`, the first that many
    requests run again afterwards, alone and with the prefix cache reset: the peer's workload, under
    ``"compared"``."""
    async with common.open_engine(ctx, longest_request(requests)) as engine:
        metrics = await _timed(engine, requests, temperature, progress(len(requests), "asyncllm", ctx.show_progress))
        metrics["num_preemptions"] = engine.stats().num_preemptions_total
        if num_compared is not None:
            await engine.reset_prefix_cache()
            subset = requests[:num_compared]
            metrics["compared"] = await _timed(engine, subset, temperature,
                                               progress(len(subset), "asyncllm, the peer's requests", ctx.show_progress))
    return metrics


async def _timed(engine: Any, requests: list[BenchRequest], temperature: float, bar: Any) -> dict[str, Any]:
    from asyncllm import SamplingParams

    async def one(request: BenchRequest) -> int:
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=temperature)
        out = await engine.generate(request.prompt_token_ids, params)
        bar.update(1)
        return len(out.token_ids)

    start = time.perf_counter()
    generated = await asyncio.gather(*(one(r) for r in requests))
    elapsed = time.perf_counter() - start
    bar.close()
    check_output_tokens(requests, sum(generated))
    prompt_tokens, output_tokens = total_tokens(requests)
    return {
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }


def fill_workload_defaults(args: argparse.Namespace) -> None:
    """The workload flags not given: `TINY_WORKLOAD`'s with ``--preset tiny``, else `GPU_WORKLOAD`'s."""
    defaults = TINY_WORKLOAD if args.preset == "tiny" else GPU_WORKLOAD
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    fill_workload_defaults(args)
    ctx = common.make_context(args, argv)
    requests = uniform_requests(args.num_requests, args.input_len_range, args.output_len_range,
                                ctx.model.vocab_size, args.seed)
    common.check_fits(ctx, longest_request(requests), "--input-len-range {},{} + --output-len-range {},{}".format(
        *args.input_len_range, *args.output_len_range))
    n = args.compare_num_requests
    num_compared = n if args.compare and n and n < len(requests) else None  # a subset: run again alone
    metrics = worker_trace.run_traced(
        args, lambda: asyncio.run(run_engine(ctx, requests, args.temperature, num_compared)))
    line = common.roofline(ctx, *decode_shape(requests, common.max_num_seqs(args)))
    budget = common.compare_budget(args, COMPARE_TIME_BUDGET_S)
    peers = None
    if args.compare == "hf":
        from asyncllm.bench import hf_peer

        peers = hf_peer.throughput_peers(ctx, requests[:num_compared], args.hf_batch_size, budget)
    settings = {"num_requests": args.num_requests, "input_len_range": list(args.input_len_range),
                "output_len_range": list(args.output_len_range), "temperature": args.temperature,
                "compare_num_requests": args.compare_num_requests, "hf_batch_size": args.hf_batch_size,
                "compare_time_budget_s": budget if args.compare else None, "worker_trace": args.worker_trace}
    return common.finish(ctx, "throughput", settings, metrics, line, metrics["output_tokens_per_s"],
                         peers, "output_tokens_per_s")
