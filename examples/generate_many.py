"""A batch job: many prompts, a progress bar, results in input order.

    python examples/generate_many.py
"""

import asyncio

from asyncllm import AsyncEngine, SamplingParams


async def main() -> None:
    prompts = [f"def function_{i}(" for i in range(200)]
    # one SamplingParams per prompt, each with its own seed: reproducible, and not one random stream for all
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=i) for i in range(len(prompts))]
    async with AsyncEngine(disable_log_stats=True) as engine:
        outputs = await engine.generate_many(prompts, params, progress=True)
    for prompt, out in list(zip(prompts, outputs))[:3]:
        print(prompt + out.text)
        print("-" * 40)


if __name__ == "__main__":
    asyncio.run(main())
