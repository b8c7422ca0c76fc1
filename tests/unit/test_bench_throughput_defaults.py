"""`asyncllm bench throughput --preset tiny` (CPU runs) defaults to a workload of seconds, not the GPU's 256 long
requests (hours on a CPU); a flag given is kept (asyncllm/bench/throughput.py)."""

from __future__ import annotations

from asyncllm.bench.cli import parser as bench_parser


def _filled(*flags: str) -> tuple:
    from asyncllm.bench.throughput import fill_workload_defaults

    args = bench_parser().parse_args(["throughput", *flags])
    fill_workload_defaults(args)
    return args.num_requests, args.input_len_range, args.output_len_range


def test_the_tiny_preset_defaults_to_the_cpu_workload() -> None:
    assert _filled("--preset", "tiny") == (8, (8, 32), (4, 16))
    assert _filled("--preset", "tiny", "--num-requests", "3") == (3, (8, 32), (4, 16))
    assert _filled() == (256, (100, 1024), (100, 1024))
