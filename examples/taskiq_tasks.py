"""A task runner (taskiq): async tasks that share one engine per worker process.

Runs as is with taskiq's in-memory broker; in production swap in a real
broker (taskiq-redis, taskiq-aio-pika) and start workers with
`taskiq worker examples.taskiq_tasks:broker`. Each worker process owns one engine,
or attaches to a shared core with `AsyncEngine.connect()` (see examples/shared_engine).

    pip install taskiq && python examples/taskiq_tasks.py
"""

import asyncio

from taskiq import InMemoryBroker, TaskiqEvents, TaskiqState

from asyncllm import AsyncEngine, SamplingParams

broker = InMemoryBroker()
engine = AsyncEngine(disable_log_stats=True)  # cheap to construct; started by the worker's startup hook


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def start_engine(state: TaskiqState) -> None:
    await engine.start()


@broker.on_event(TaskiqEvents.WORKER_SHUTDOWN)
async def stop_engine(state: TaskiqState) -> None:
    await engine.aclose()


@broker.task
async def complete(prompt: str, max_tokens: int = 32, seed: int | None = None) -> str:
    """`seed`: a task's own, for a reproducible sample (one seed for every task would give them one random stream)."""
    out = await engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed))
    return out.text


async def main() -> None:
    await broker.startup()
    tasks = [await complete.kiq(f"def task_{i}(", seed=i) for i in range(4)]
    for task in tasks:
        result = await task.wait_result(timeout=120)
        print(repr(result.return_value))
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
