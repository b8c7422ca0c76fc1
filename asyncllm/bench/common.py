"""What every workload shares: the command-line flags, the engine, warm-up, roofline and report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
from dataclasses import dataclass
from typing import Any, AsyncIterator

import torch

from asyncllm.bench import report
from asyncllm.config_model import DTYPE_ALIASES
from asyncllm.bench.model import PRESETS, BenchModel, resolve_bench_model
from asyncllm.bench.roofline import Roofline, decode_roofline, measure_copy_bandwidth
from asyncllm.config import default_max_num_seqs
from asyncllm.errors import ConfigError

__all__ = ["add_common_args", "BenchContext", "make_context", "check_fits", "open_engine", "finish", "int_range",
           "compare_budget"]


def compare_budget(args: argparse.Namespace, default_s: float) -> float:
    """The peer's time limit: --compare-time-budget, else the benchmark's default."""
    return args.compare_time_budget or default_s


def int_range(text: str) -> tuple[int, int]:
    """``"100,1024"`` or ``"100:1024"`` -> (100, 1024), inclusive."""
    parts = text.replace(":", ",").split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}")
    lo, hi = int(parts[0]), int(parts[1])
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


def bench_max_model_len(text: str) -> int:
    """An argparse type: ``--max-model-len``, at least 1, in vLLM's human-readable form too (``4k``, ``2K``). vLLM's
    -1 / ``auto`` (the engine core fits it to the KV cache) is not built for bench, which sizes its engine from the
    workload's longest request."""
    if text.strip().lower() in ("-1", "auto"):
        raise argparse.ArgumentTypeError(f"{text} (auto: fit to the KV cache) is not built for asyncllm bench; give "
                                         "a length of at least 1, or leave it unset for the workload's longest "
                                         "request")
    return human_size(text)


def human_size(text: str) -> int:
    """An argparse type: a count of at least 1, as vLLM's flags write them (``4k`` = 4000, ``2K`` = 2048)."""
    from asyncllm.cli_args import human_readable_int

    try:
        value = human_readable_int(text)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"not an integer (or 4k, 2K ...): {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (``inf`` allowed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"above 0, got {text}")
    return value


def add_common_args(parser: argparse.ArgumentParser, overlapped_steps: bool = True) -> None:
    """The model, engine and output flags; ``--async-scheduling`` only for workloads that run the engine's
    own loop (``overlapped_steps``)."""
    model = parser.add_argument_group("model and engine")
    model.add_argument("--model", help="a local checkpoint folder")
    model.add_argument("--preset", choices=PRESETS,
                       help="a shipped model shape with dummy weights (tiny: asyncllm's tiny Llama)")
    model.add_argument("--load-format", choices=("auto", "safetensors", "dummy"), default=None,
                       help="default: dummy for shape presets, auto otherwise")
    model.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                       type=lambda name: DTYPE_ALIASES.get(name, name),
                       help="vLLM's half and float are float16 and float32")
    model.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    model.add_argument("--max-num-seqs", type=int, default=None,
                       help="default: the engine's, 256 at most --max-num-batched-tokens")
    model.add_argument("--max-num-batched-tokens", type=human_size, default=None)
    model.add_argument("--max-model-len", type=bench_max_model_len, default=None, help="default: the workload's longest request")
    model.add_argument("--attention-backend", default=None, help="torch_sdpa or triton (default: the device's)")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    model.add_argument("--pipeline-parallel-size", type=int, default=1,
                       help="decoder layers over this many stages (docs/parallelism.md)")
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    model.add_argument("--enforce-eager", action="store_true")
    model.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                       help="an fp8 KV cache (docs/fp8-kv-cache.md); the roofline counts its bytes")
    model.add_argument("--quantization", default=None, choices=("fp8",),
                       help="online fp8 weight quantization (docs/quantization.md); the roofline counts its bytes")
    model.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE models: split the experts whole over the tensor-parallel ranks (docs/moe.md)")
    if overlapped_steps:
        model.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                           help="schedule step N+1 while the workers run step N (docs/scheduling.md; the engine's "
                                "default); --no-async-scheduling runs every step synchronously")
    model.add_argument("--speculative-config", type=json.loads, default=None,
                       help="speculative decoding as JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                            "(docs/speculative.md; drafts need outputs that repeat their context, which random "
                            "prompts on dummy weights seldom do)")
    model.add_argument("--seed", type=int, default=0, help="seeds the synthetic workload and the engine")
    out = parser.add_argument_group("output")
    out.add_argument("--output-json", help="write the result (metadata, settings, metrics) to this file")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class BenchContext:
    """A run's settings, resolved once."""

    args: argparse.Namespace
    model: BenchModel
    device: torch.device
    dtype: torch.dtype
    argv: list[str] | None

    @property
    def show_progress(self) -> bool:
        return not self.args.no_progress


def make_context(args: argparse.Namespace, argv: list[str] | None) -> BenchContext:
    from asyncllm.models.loader import load_hf_config, resolve_dtype

    model = resolve_bench_model(args.model, args.preset, args.load_format)
    device_name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device_name)
    dtype = resolve_dtype(args.dtype, load_hf_config(model.path), device)
    return BenchContext(args, model, device, dtype, argv)


def effective_max_model_len(ctx: BenchContext, longest: int) -> int:
    """The engine's max_model_len: ``--max-model-len``, else the workload's `longest` request capped at the model's
    max_position_embeddings."""
    return ctx.args.max_model_len or min(longest, ctx.model.max_position_embeddings)


def check_fits(ctx: BenchContext, longest: int, lengths: str) -> None:
    """`ConfigError` before the engine starts when the workload's `longest` request (prompt + output; `lengths` names
    the flags that drew it) does not fit the engine's max_model_len: the engine would cut its output and the token
    count check would fail after the whole run."""
    limit = effective_max_model_len(ctx, longest)
    if longest <= limit:
        return
    source = ("it comes from --max-model-len: raise it or shorten the workload" if ctx.args.max_model_len else
              "it is the model's max_position_embeddings: shorten the workload")
    raise ConfigError("max_model_len", limit, f"at least the longest request, {longest} tokens ({lengths}); "
                                              f"{source} (checked before the run)")


def max_num_seqs(args: argparse.Namespace) -> int:
    """The engine's max_num_seqs: --max-num-seqs, else its default, 256 at most --max-num-batched-tokens."""
    return args.max_num_seqs if args.max_num_seqs is not None else default_max_num_seqs(args.max_num_batched_tokens)


def engine_kwargs(ctx: BenchContext, max_model_len: int) -> dict[str, Any]:
    a = ctx.args
    kwargs: dict[str, Any] = dict(
        load_format=ctx.model.load_format, dtype=str(ctx.dtype).removeprefix("torch."), device=ctx.device.type,
        max_model_len=effective_max_model_len(ctx, max_model_len),
        attention_backend=a.attention_backend, tensor_parallel_size=a.tensor_parallel_size,
        pipeline_parallel_size=getattr(a, "pipeline_parallel_size", 1),
        gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager, seed=a.seed,
        kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization, enable_expert_parallel=a.enable_expert_parallel,
        async_scheduling=getattr(a, "async_scheduling", False),
        disable_log_stats=True,
    )
    for key in ("max_num_seqs", "max_num_batched_tokens"):  # unset: the engine's defaults
        if getattr(a, key) is not None:
            kwargs[key] = getattr(a, key)
    if getattr(a, "speculative_config", None) is not None:
        kwargs["speculative_config"] = a.speculative_config
    return kwargs


@contextlib.asynccontextmanager
async def open_engine(ctx: BenchContext, max_model_len: int) -> AsyncIterator[Any]:
    """A started engine, warmed up with a few requests of mixed lengths (kernel compilation, first allocations)."""
    from asyncllm import AsyncEngine, SamplingParams

    async with AsyncEngine(ctx.model.path, **engine_kwargs(ctx, max_model_len)) as engine:
        rng = random.Random(ctx.args.seed + 1)
        lengths = [n for n in (5, 17, 33, 64) if n < max_model_len - 8] or [1]
        prompts = [[rng.randrange(10, ctx.model.vocab_size) for _ in range(n)] for n in lengths]
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        yield engine


def roofline(ctx: BenchContext, decode_batch: float, mean_context: float) -> Roofline:
    """The decode roofline on this device: measured copy bandwidth, the model's bytes (an MXFP4 checkpoint's experts
    packed where the engine serves them so: the triton backend, CUDA's default; a pre-quantized checkpoint's
    quantized weights as served, AWQ / GPTQ / pack-quantized integers packed on CUDA only), the KV cache in the dtype
    the engine serves (``auto``: the fp8 cache a checkpoint declares, `resolve_kv_cache_dtype`)."""
    from asyncllm.attention.selector import default_backend_name
    from asyncllm.models.checkpoint import resolve_kv_cache_dtype
    from asyncllm.models.loader import load_hf_config
    from asyncllm.models.mxfp4_experts import serves_packed

    bandwidth = measure_copy_bandwidth(ctx.device)
    backend = ctx.args.attention_backend or default_backend_name(ctx.device)
    hf_config = load_hf_config(ctx.model.path)
    packed = serves_packed(hf_config, backend, ctx.args.tensor_parallel_size, ctx.args.enable_expert_parallel)
    kv_cache_dtype = resolve_kv_cache_dtype(ctx.args.kv_cache_dtype, hf_config)  # the engine's: auto may be fp8
    return decode_roofline(ctx.model.path, ctx.dtype, bandwidth, decode_batch, mean_context,
                           kv_cache_dtype, ctx.args.quantization, packed, int_packed=ctx.device.type == "cuda")


def finish(
    ctx: BenchContext, workload: str, settings: dict[str, Any], metrics: dict[str, Any],
    line: Roofline, decode_tokens_per_s: float | None, peers: dict[str, dict[str, Any]] | None = None,
    ratio_metric: str | None = None,
) -> dict[str, Any]:
    """Print the roofline and the summary table, write the JSON; returns the result. The ratios divide
    ``metrics["compared"]`` (asyncllm's metrics on the peers' workload, when that is a part of `metrics`') by the
    peers'."""
    fraction = None if decode_tokens_per_s is None else line.fraction(decode_tokens_per_s)
    a = ctx.args
    settings = {**settings, "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype,
                "async_scheduling": getattr(a, "async_scheduling", False)}  # profile's loop: synchronous
    result: dict[str, Any] = {
        "workload": workload,
        "meta": report.run_metadata(ctx.argv),
        "model": {"name": ctx.model.name, "path": ctx.model.path, "load_format": ctx.model.load_format,
                  "dtype": str(ctx.dtype).removeprefix("torch.")},
        "settings": settings,
        "metrics": metrics,
        "roofline": {**line.as_dict(), "measured_tokens_per_s": decode_tokens_per_s, "fraction": fraction},
    }
    rows = [(k, v) for k, v in metrics.items() if not isinstance(v, (list, dict))]  # lists, tables: JSON only
    if peers:
        result["peers"] = peers
        result["ratios"] = {}
        compared = metrics.get("compared")
        base = compared or metrics
        if compared is not None:
            rows.append((f"asyncllm on the peers' {compared['num_requests']} requests {ratio_metric}",
                         compared[ratio_metric]))
        for name, peer in peers.items():
            measured = base[ratio_metric] is not None and peer.get(ratio_metric)
            ratio = base[ratio_metric] / peer[ratio_metric] if measured else None
            result["ratios"][name] = ratio
            rows.append((f"{name} {ratio_metric}", peer.get(ratio_metric, "failed" if "error" in peer else "n/a")))
            if "completed" in peer:  # a peer cut by its time budget says so here and in its ratio's name
                rows.append((f"{name} completed", peer["completed"]))
            cut = " (peer cut by its time budget)" if peer.get("cut") else ""
            rows.append((f"asyncllm / {name}{cut}", "n/a" if ratio is None else ratio))
    measured = "n/a" if fraction is None else f"{decode_tokens_per_s:,.1f} = {fraction:.1%}"
    print(
        f"[roofline] {line.copy_bandwidth_gb_s:,.1f} GB/s copy bandwidth; a decode step reads "
        f"{line.weight_bytes_per_step / 1e9:.3f} GB of weights + {line.kv_bytes_per_token / 1024:.1f} KiB/token of KV "
        f"x {line.decode_batch:g} requests x {line.mean_context:.0f} tokens -> roofline "
        f"{line.output_tokens_per_s:,.1f} tokens/s; measured {measured}",
        flush=True,
    )
    rows.append(("roofline tokens/s", line.output_tokens_per_s))
    rows.append(("fraction of roofline", fraction))
    report.print_summary(f"asyncllm bench {workload} | {ctx.model.name} | {result['model']['dtype']} | "
                         f"{result['meta']['device']}", rows)
    if ctx.args.output_json:
        report.write_json(ctx.args.output_json, result)
    return result
