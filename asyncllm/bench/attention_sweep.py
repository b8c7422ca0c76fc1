"""attention-sweep: the paged-attention kernels' launch configurations on throughput-like decode steps (GPU only).

The throughput workload's decode steps spend most of their device time in the unified `paged_attention` kernel
(2026-11-30's batch-256 profile: 63% of a step, at 47% of the copy bandwidth). This times it at every
(num_warps, num_stages, tile_n) of `CONFIGS`, and the split-KV `paged_decode` at `SEGMENTS`, on decode batches like
that workload's: ``--batch-size`` requests (256), one query token each, with contexts drawn uniformly from
``--context-range`` (200-2048: a 100-1024-token prompt plus the tokens decoded so far), and the same batch at a
160-token context (the profile's). Each configuration's output is checked against the current rule's (a
configuration that computes something else is marked, never ranked); the rows come fastest first, with µs per
call, GB/s and the fraction of the measured copy bandwidth, the current rule's row marked. A GPU lease picks the
rule from it (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from collections.abc import Callable
from typing import Any

import torch

from asyncllm.bench import report
from asyncllm.bench.common import int_range, positive_int

__all__ = ["CONFIGS", "SEGMENTS", "add_args", "run", "sweep"]

CONFIGS = list(itertools.product((2, 4, 8), (1, 2, 3, 4), (32, 64, 128)))
"""(num_warps, num_stages, tile_n) of the unified kernel."""
SEGMENTS = (2, 4)
"""Split-KV segments per request of `paged_decode` (its own launch rule otherwise)."""
CURRENT = (8, 2, 64)
"""The unified kernel's rule at head dim 128 (kernels/paged_attention.py)."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="qwen3-0.6b", choices=("qwen3-0.6b", "llama3.1-8b"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--batch-size", type=positive_int, default=256, help="decoding requests")
    parser.add_argument("--context-range", type=int_range, default=(200, 2048),
                        help="LO,HI: each request's context, uniform")
    parser.add_argument("--output-json", help="write the results to this file")
    parser.add_argument("--no-progress", action="store_true", help="accepted for symmetry: there is no bar")


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        print("asyncllm bench attention-sweep: the sweep needs a CUDA device, and none is visible; nothing to measure "
              "here (the kernels' correctness tests run on the CPU under TRITON_INTERPRET=1).", file=sys.stderr)
        return None
    from asyncllm.bench.kernel_steps import attention_step
    from asyncllm.bench.kernels import time_ms
    from asyncllm.bench.model import preset_config
    from asyncllm.bench.roofline import measure_copy_bandwidth

    lo, hi = args.context_range
    bandwidth = measure_copy_bandwidth(torch.device("cuda"))
    cfg, dtype, rng = preset_config(args.preset), getattr(torch, args.dtype), random.Random(0)
    cases = {f"{args.batch_size} x context {lo}-{hi}": [(rng.randint(lo, hi) - 1, 1) for _ in range(args.batch_size)],
             f"{args.batch_size} x context 160": [(159, 1)] * args.batch_size}
    results: dict[str, Any] = {"meta": report.run_metadata(argv), "preset": args.preset, "dtype": args.dtype,
                               "copy_bandwidth_gb_s": bandwidth / 1e9, "cases": {}}
    for name, requests in cases.items():
        rows = sweep(attention_step(cfg, requests, dtype, random.Random(0)), time_ms, bandwidth)
        results["cases"][name] = rows
        _print(f"asyncllm bench attention-sweep | {args.preset} | {name} | {results['meta']['device']}", rows)
    if args.output_json:
        report.write_json(args.output_json, results)
    return results


def sweep(step: Any, time_ms: Callable[[Callable[[], Any]], float], bandwidth: float,
          configs: list[tuple[int, int, int]] = CONFIGS, segments: tuple[int, ...] = SEGMENTS) -> list[dict[str, Any]]:
    """One row per configuration (the unified kernel's ``configs``, then ``paged_decode`` at ``segments``), fastest
    first; a configuration that fails to launch or computes other values than the current rule has ``error`` and no
    time. ``time_ms(fn)``: milliseconds per call of ``fn``."""
    from asyncllm.kernels.paged_attention import paged_attention
    from asyncllm.kernels.paged_decode import paged_decode

    md, q, cache = step.metadata, step.query, step.kv_cache
    args = (q, cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, step.head_dim**-0.5)
    expected = paged_attention(*args)
    candidates: list[tuple[str, Callable[[], torch.Tensor]]] = [
        (f"unified warps={w} stages={s} tile_n={t}",
         lambda w=w, s=s, t=t: paged_attention(*args, tile_n=t, num_warps=w, num_stages=s)) for w, s, t in configs
    ] + [(f"split-KV segments={n}", lambda n=n: paged_decode(*args, n)) for n in segments]
    current = "unified warps={} stages={} tile_n={}".format(*CURRENT)
    rows = [_measure(name, fn, expected, time_ms, step.bytes_read, bandwidth, name == current)
            for name, fn in candidates]
    return sorted(rows, key=lambda r: (r["us"] is None, r["us"] or 0.0))


def _measure(name: str, fn: Callable[[], torch.Tensor], expected: torch.Tensor, time_ms: Callable, nbytes: int,
             bandwidth: float, current: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"config": name, "current": current, "us": None, "gb_s": None, "fraction_of_copy_bw": None}
    try:
        out = fn()
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)  # another summation order, same values
        ms = time_ms(fn)
    except Exception as exc:  # a configuration past the GPU's resources, or a wrong one: reported, not ranked
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return row
    achieved = nbytes / (ms / 1000)
    return {**row, "us": 1000 * ms, "gb_s": achieved / 1e9, "fraction_of_copy_bw": achieved / bandwidth}


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    print(f"{'configuration':<44} {'us':>10} {'GB/s':>8} {'of copy':>8}")
    for r in rows:
        mark = "  <- current rule" if r["current"] else ""
        if r["us"] is None:
            print(f"{r['config']:<44} {r['error']}{mark}")
        else:
            print(f"{r['config']:<44} {r['us']:>10.1f} {r['gb_s']:>8.0f} {r['fraction_of_copy_bw']:>8.1%}{mark}",
                  flush=True)
