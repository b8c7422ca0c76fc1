"""profile: where one decode step's time goes; phase times and the device's kernels by kind.

Runs the engine core's synchronous step loop in this process (the real
`Scheduler` and `ModelRunner`, no processes, no sockets, one rank):
``--batch-size`` requests of ``--input-len`` random prompt tokens are
prefilled, then ``--num-steps`` decode steps are timed phase by phase
(``schedule()``, the model step up to the sampled ids on the host,
``update_from_output()``), and ``--profile-steps`` more run under
torch.profiler. The report gives the device's busy time and kernel launches
per step, the kernels grouped by kind (matmul, attention, norm, rotary,
activation, sampling, copy, other) and the top kernels by time, and the
runner's host time per phase of the timed steps (``host_ms``: ``update``,
``prepare``, ``forward``, ``logits``, ``sample``, timed by the clock alone, no
profiler; ``wait``, the rest of the model step: waiting for the sampled ids and
what no phase covers). In this synchronous loop a phase's host time is what
it costs to enqueue its work, unless it waits for the device inside (a host
sync shows as that phase's time). Busy time
against the step's wall time is what the host leaves idle; the matmul time
against the weight bytes at copy bandwidth is how far the GEMMs are from
memory-bound. Overlap across steps (async scheduling, the workers' pipelined
steps) is not in this loop: the latency and throughput workloads measure it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from asyncllm.bench import common
from asyncllm.bench.report import print_summary
from asyncllm.errors import ConfigError
from asyncllm.workers.trace_summary import kernel_kind

if TYPE_CHECKING:
    from asyncllm.config import EngineConfig

__all__ = ["add_args", "run"]

def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=common.positive_int, default=1, help="requests decoding together")
    parser.add_argument("--input-len", type=common.positive_int, default=128)
    parser.add_argument("--num-steps", type=common.positive_int, default=50, help="decode steps timed phase by phase")
    parser.add_argument("--profile-steps", type=int, default=10, help="decode steps run under torch.profiler")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="kernels listed by time")


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    if args.tensor_parallel_size != 1:
        raise ConfigError("tensor_parallel_size", args.tensor_parallel_size,
                          "1: the profile runs one rank in this process")
    if args.pipeline_parallel_size != 1:
        raise ConfigError("pipeline_parallel_size", args.pipeline_parallel_size,
                          "1: the profile runs one rank in this process")
    for name in ("batch_size", "input_len", "num_steps", "profile_steps"):
        if getattr(args, name) < 1:
            raise ConfigError(name, getattr(args, name), "at least 1")
    ctx = common.make_context(args, argv)
    num_decodes = args.warmup_steps + args.num_steps + args.profile_steps
    common.check_fits(ctx, args.input_len + num_decodes + 2, f"--input-len {args.input_len} + --warmup-steps "
                      f"{args.warmup_steps} + --num-steps {args.num_steps} + --profile-steps {args.profile_steps} + 2")
    loop = _StepLoop(ctx, args.batch_size, args.input_len, num_decodes + 2)
    loop.prefill()
    for _ in range(args.warmup_steps):
        loop.step()
    loop.host.take()
    phases, host = [], []
    for _ in range(args.num_steps):
        phases.append(loop.step())
        host.append(loop.host.take())
    kernels = _profile(loop, args.profile_steps, ctx.device)
    step_s = statistics.median(sum(p) for p in phases)
    metrics: dict[str, Any] = {
        "step_ms": step_s * 1e3,
        "schedule_ms": statistics.median(p[0] for p in phases) * 1e3,
        "model_ms": statistics.median(p[1] for p in phases) * 1e3,
        "update_ms": statistics.median(p[2] for p in phases) * 1e3,
        "decode_tokens_per_s": args.batch_size / step_s,
        "host_ms": _host_ms(phases, host),
        **_kernel_metrics(kernels, args.profile_steps, args.top),
    }
    metrics["device_busy_fraction"] = metrics["device_ms"] / metrics["step_ms"] if metrics["step_ms"] else 0.0
    _print_kernels(metrics)
    line = common.roofline(ctx, args.batch_size, args.input_len + num_decodes / 2)
    graphs = loop.runner.cuda_graphs
    settings = {"batch_size": args.batch_size, "input_len": args.input_len, "num_steps": args.num_steps,
                "profile_steps": args.profile_steps, "graphs": graphs is not None,
                "greedy_graph_replays": graphs.num_greedy_replays if graphs is not None else 0}
    return common.finish(ctx, "profile", settings, metrics, line, metrics["decode_tokens_per_s"])


class _StepLoop:
    """The engine core's synchronous loop over one in-process rank: schedule, run, update."""

    def __init__(self, ctx: common.BenchContext, batch_size: int, input_len: int, output_len: int) -> None:
        from asyncllm.config import EngineConfig
        from asyncllm.engine.prepare import prepare
        from asyncllm.sampling import SamplingParams
        from asyncllm.sched.request import Request
        from asyncllm.sched.scheduler import Scheduler
        from asyncllm.workers.model_runner import ModelRunner

        max_len = input_len + output_len
        config = prepare(EngineConfig.create(ctx.model.path, **common.engine_kwargs(ctx, max_len))).config
        if batch_size > config.max_num_seqs:
            raise ConfigError("batch_size", batch_size, f"at most --max-num-seqs ({config.max_num_seqs})")
        config = config.replace(long_prefill_token_threshold=_prefill_chunk(config, batch_size))
        self.batch_size = batch_size
        self.runner = ModelRunner(config, rank=0, tp_size=1, device=ctx.device)
        self.runner.load_model()
        num_blocks = batch_size * -(-max_len // config.block_size)
        available = self.runner.determine_num_available_blocks()  # gpu_memory_utilization (CPU: the KV budget)
        if available < num_blocks:
            raise ConfigError("batch_size", batch_size, f"a batch whose KV cache fits: {num_blocks} blocks needed, "
                              f"{available} available (lower --batch-size or --input-len)")
        self.runner.init_cache(num_blocks)
        self.scheduler = Scheduler(config, num_blocks, config.max_model_len)
        rng = random.Random(ctx.args.seed)
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        for i in range(batch_size):
            prompt = [rng.randrange(10, ctx.model.vocab_size) for _ in range(input_len)]
            self.scheduler.add_request(Request(f"profile-{i}", prompt, params, [], time.time()))
        self.sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
        self.host = _HostClock(self.runner)

    def prefill(self) -> None:
        """Every prompt, in the same steps (`_prefill_chunk`): each request then holds one output token."""
        while self.scheduler.waiting or any(r.num_output_tokens == 0 for r in self.scheduler.running):
            self.step(decode=False)
        outputs = sorted({r.num_output_tokens for r in self.scheduler.running})
        if len(self.scheduler.running) != self.batch_size or outputs != [1]:
            raise RuntimeError(f"after the prefill {len(self.scheduler.running)} of {self.batch_size} requests run, "
                               f"with {outputs} output tokens (one each expected: a request that decodes while "
                               "others prefill runs ahead and stops before the profile's last step)")

    def step(self, decode: bool = True) -> tuple[float, float, float]:
        """One step; its (schedule, model, update) seconds."""
        scheduler = self.scheduler
        self.sync()
        t0 = time.perf_counter()
        sched_out = scheduler.schedule()
        t1 = time.perf_counter()
        runner_out = self.runner.execute_model(sched_out)  # returns once the sampled ids are on the host
        t2 = time.perf_counter()
        scheduler.update_from_output(sched_out, runner_out)
        t3 = time.perf_counter()
        if decode and sched_out.total_num_scheduled_tokens != self.batch_size:
            preempted = scheduler.num_preemptions_total
            advice = ("the KV cache ran short: lower --batch-size, --input-len or the step counts" if preempted else
                      "a request finished early, a bug of this loop: each request's max_tokens covers one token "
                      "from the prefill and --warmup-steps + --num-steps + --profile-steps decodes")
            raise RuntimeError(f"a decode step ran {sched_out.total_num_scheduled_tokens} tokens, not one for each "
                               f"of {self.batch_size} requests ({len(scheduler.running)} running, "
                               f"{len(scheduler.waiting)} waiting, {preempted} preemptions): {advice}")
        return t1 - t0, t2 - t1, t3 - t2


class _HostClock:
    """Host seconds per step phase of the runner (workers/step_trace.py's phases within a launch), by the clock."""

    PHASES = ("update", "prepare", "forward", "logits", "sample")

    def __init__(self, runner: Any) -> None:
        from asyncllm.workers.step_trace import runner_phases

        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        for owner, attr, phase in runner_phases(runner):
            method = getattr(owner, attr, None)
            if phase in self.PHASES and method is not None:
                setattr(owner, attr, self._timed(method, phase))

    def _timed(self, method: Any, phase: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        """The seconds since the last take, per phase."""
        seconds, self.seconds = self.seconds, dict.fromkeys(self.PHASES, 0.0)
        return seconds


def _host_ms(phases: list[tuple[float, float, float]], host: list[dict[str, float]]) -> dict[str, float]:
    """Median host ms per phase over the timed steps; ``wait``: the rest of the (median) model step, so that the
    phases add up to ``model_ms`` (a median of each step's rest did not, by far on a loaded machine)."""
    medians = {name: statistics.median(h[name] for h in host) * 1e3 for name in _HostClock.PHASES}
    medians["wait"] = max(0.0, statistics.median(p[1] for p in phases) * 1e3 - sum(medians.values()))
    return medians


def _prefill_chunk(config: EngineConfig, batch_size: int) -> int:
    """The prefill's chunk per request and step (long_prefill_token_threshold): the step's token budget shared by
    the batch, so that every prompt advances alike and all end in the same step. A request that ended its prompt
    earlier would decode while the others prefill and reach its max_tokens (sized for the timed and profiled steps)
    before the last of them (at batch 256, the first 64 of 128-token prompts under 8192 tokens a step ran 4 ahead)."""
    return max(1, config.resolved_max_num_batched_tokens // batch_size)


def _profile(loop: _StepLoop, steps: int, device: torch.device) -> list[tuple[str, float, int]]:
    """(name, total microseconds, calls) of every device kernel (CPU: every operator's own time) in `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            loop.step()
        loop.sync()
    rows = []
    for event in prof.key_averages():
        if cuda:
            us = float(getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0))
            on_device = str(getattr(event, "device_type", "")).endswith("CUDA")
            if not on_device or us <= 0:
                continue
        else:
            us = float(event.self_cpu_time_total)
            if us <= 0 or not event.key.startswith("aten::"):
                continue
        rows.append((event.key, us, int(event.count)))
    return rows


def _kernel_metrics(kernels: list[tuple[str, float, int]], steps: int, top: int) -> dict[str, Any]:
    """Per-step device time and launches, by kind and for the top kernels."""
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, us, calls in kernels:
        entry = by_kind[kernel_kind(name)]
        entry[0] += us / 1e3 / steps
        entry[1] += calls / steps
    ranked = sorted(kernels, key=lambda k: -k[1])[:top]
    return {
        "device_ms": sum(us for _, us, _ in kernels) / 1e3 / steps,
        "launches_per_step": sum(calls for _, _, calls in kernels) / steps,
        "kinds": {kind: {"ms_per_step": ms, "launches_per_step": n}
                  for kind, (ms, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])},
        "top_kernels": [{"name": name, "kind": kernel_kind(name), "ms_per_step": us / 1e3 / steps,
                         "launches_per_step": calls / steps} for name, us, calls in ranked],
    }


def _print_kernels(metrics: dict[str, Any]) -> None:
    print_summary("host ms per decode step, by phase (clock only, no profiler)", list(metrics["host_ms"].items()))
    rows: list[tuple[str, Any]] = [(f"{kind} ms/step ({v['launches_per_step']:.0f} launches)", v["ms_per_step"])
                                   for kind, v in metrics["kinds"].items()]
    rows += [(f"{k['name'][:70]} [{k['kind']}] x{k['launches_per_step']:.0f}", k["ms_per_step"])
             for k in metrics["top_kernels"]]
    print_summary("device time per decode step, by kind, then the top kernels", rows)
