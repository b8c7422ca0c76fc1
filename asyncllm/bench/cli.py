"""``asyncllm bench WORKLOAD [flags]``: parse, run the workload, exit 0 (or 2 on a bad flag).

The workloads and what they measure are in docs/benchmarks.md; every run
prints the decode roofline and a summary table, ``--output-json`` saves it.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType
from typing import Any

from asyncllm.bench import (
    attention_sweep, common, kernels, latency, loop_lag, profile, scheduler, serve, soak, throughput,
)
from asyncllm import envs
from asyncllm.errors import AsyncLLMError, ConfigError

__all__ = ["main", "parser", "WORKLOADS"]

WORKLOADS: dict[str, tuple[ModuleType, str]] = {
    "throughput": (throughput, "many requests at once: output and total tokens/s"),
    "latency": (latency, "one request at a time: decode tokens/s and TTFT"),
    "serve": (serve, "Poisson arrivals through the async API: TTFT and ITL p50/p99"),
    "loop-lag": (loop_lag, "host event-loop lag while 256 streams are consumed"),
    "soak": (soak, "2,000 streams for 10 minutes, random cancels and timeouts: no leak, no hang"),
    "profile": (profile, "one decode step's phases and device kernels by kind (in-process, synchronous)"),
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="asyncllm bench", description="asyncllm's standard benchmark workloads")
    workloads = top.add_subparsers(dest="workload", required=True)
    for name, (module, help_text) in WORKLOADS.items():
        sub = workloads.add_parser(name, help=help_text, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_args(sub)
        common.add_common_args(sub, overlapped_steps=module is not profile)
    kernel_parser = workloads.add_parser("kernels", help="Triton kernel micro-benchmarks (GPU only)",
                                         description=kernels.__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
    kernels.add_args(kernel_parser)
    sweep_parser = workloads.add_parser("attention-sweep", help="paged-attention launch configurations (GPU only)",
                                        description=attention_sweep.__doc__,
                                        formatter_class=argparse.RawDescriptionHelpFormatter)
    attention_sweep.add_args(sweep_parser)
    workloads.add_parser("scheduler", help="the scheduler alone, no model (asyncllm bench scheduler --help)",
                         add_help=False)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["scheduler"]:  # its own parser (asyncllm.bench.scheduler)
        scheduler.main(argv[1:])
        return 0
    args = parser().parse_args(argv)
    try:
        run(args, argv)
    except AsyncLLMError as exc:  # a bad value (ConfigError, InvalidRequestError): one line, as a bad flag
        print(f"asyncllm bench: {exc}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace, argv: list[str]) -> Any:
    envs.check_at_start()  # the environment's values, before transformers' import reads HF_HUB_ETAG_TIMEOUT
    output_json = getattr(args, "output_json", None)
    if output_json and not os.path.isdir(os.path.dirname(os.path.abspath(output_json))):
        raise ConfigError("output_json", output_json, "a file in a folder that exists (checked before the run)")
    if output_json and os.path.isdir(output_json):
        raise ConfigError("output_json", output_json, "a file, not a folder (checked before the run)")
    if args.workload == "kernels":
        return kernels.run(args, argv)
    if args.workload == "attention-sweep":
        return attention_sweep.run(args, argv)
    module, _ = WORKLOADS[args.workload]
    if getattr(args, "compare", None) and args.preset is None and args.model is None:
        raise ConfigError("compare", args.compare, "a --model or --preset")
    for flag in ("compare_time_budget", "compare_num_requests"):
        if getattr(args, flag, None) is not None and not args.compare:
            raise ConfigError("--" + flag.replace("_", "-"), getattr(args, flag), "only with --compare hf")
    if getattr(args, "compare", None):
        if getattr(args, "temperature", 0.0):  # transformers' peers decode greedily
            raise ConfigError("temperature", args.temperature, "0 with --compare hf (the peers decode greedily)")
        _check_peer_reads_the_same_weights(args)
    return module.run(args, argv)


def _check_peer_reads_the_same_weights(args: argparse.Namespace) -> None:
    """`ConfigError` for ``--compare hf`` where the peer would not run what asyncllm runs, so the ratio would not
    compare like with like (docs/benchmarks.md): fp8 weights or KV cache (the peer runs unquantized, in the model
    dtype), or an MXFP4 checkpoint (transformers' ``from_config`` builds bfloat16 experts where asyncllm serves packed
    MXFP4 ones)."""
    from asyncllm.bench.model import resolve_bench_model
    from asyncllm.models.checkpoint import checkpoint_quantization
    from asyncllm.models.loader import load_hf_config

    for flag, value in (("quantization", args.quantization), ("kv_cache_dtype", args.kv_cache_dtype)):
        if value not in (None, "auto"):
            raise ConfigError("compare", args.compare, f"no --{flag.replace('_', '-')} {value}: transformers' peer "
                                                       "would run unquantized, in the model dtype")
    path = resolve_bench_model(args.model, args.preset).path
    if checkpoint_quantization(load_hf_config(path)) == "mxfp4":
        raise ConfigError("compare", args.compare, "a model whose weights transformers' peer reads as asyncllm does; "
                                                   f"{path} is MXFP4 (the peer would build bfloat16 experts)")


if __name__ == "__main__":
    sys.exit(main())
