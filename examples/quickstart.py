"""Stream a completion from the bundled tiny model (no download), or from MODEL.

    python examples/quickstart.py [MODEL]
"""

import asyncio
import sys

from asyncllm import AsyncEngine, SamplingParams


async def main(model: str | None) -> None:
    async with AsyncEngine(model) as engine:  # None: the bundled tiny model
        async for delta in engine.stream("def fibonacci(n):", SamplingParams(max_tokens=48, temperature=0.0)):
            print(delta.text, end="", flush=True)
        print()
        out = await engine.generate("import os\n", SamplingParams(max_tokens=16))
        print(f"{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
              f"ttft={out.metrics.time_to_first_token:.3f}s")
        print(engine.stats())


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else None))
