"""The `asyncllm` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys

from asyncllm.sampling import SamplingParams


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncllm: an embeddable LLM engine")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("prompt", nargs="?", default="def fibonacci(n):", help="the prompt (default: %(default)r)")
    gen.add_argument("--model", default=None,
                     help="local folder or hub id; default: a tiny random Llama made locally (no download)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--tensor-parallel-size", type=int, default=1)
    gen.add_argument("--dtype", default="auto")
    return parser


async def _generate(args: argparse.Namespace) -> None:
    from asyncllm import AsyncEngine

    model = args.model
    if model is None:
        from asyncllm.tiny import tiny_checkpoint

        model = tiny_checkpoint("llama")
        print(f"[asyncllm] no --model given: using a tiny random Llama made locally at {model}", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    engine = AsyncEngine(model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size, disable_log_stats=True)
    async with engine:
        sys.stdout.write(args.prompt)
        async for delta in engine.stream(args.prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.finished:
                print(f"\n[asyncllm] finish_reason={delta.finish_reason}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "generate":
        asyncio.run(_generate(args))


if __name__ == "__main__":
    main()
