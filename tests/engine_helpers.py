"""Helpers shared by the engine tests."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

from asyncllm import AsyncEngine


async def wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> None:
    """Wait until the core reports nothing running or waiting and no KV block in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_requests_running == 0 and s.num_requests_waiting == 0 and s.num_used_blocks == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {engine.stats()}")


@contextmanager
def worker_pipeline_on() -> Iterator[None]:
    """Workers started inside pipeline their steps even on the CPU (ASYNCLLM_WORKER_PIPELINE=1, read at their start).

    The default pipelines on CUDA only; this puts the CPU engine tests on the same path.
    """
    before = os.environ.get("ASYNCLLM_WORKER_PIPELINE")
    os.environ["ASYNCLLM_WORKER_PIPELINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["ASYNCLLM_WORKER_PIPELINE"]
        else:
            os.environ["ASYNCLLM_WORKER_PIPELINE"] = before


async def snapshot_before_first_output(engine: AsyncEngine, prompt: list[int]) -> tuple[int, int]:
    """(running, waiting) of the last stats snapshot the host heard before a lone request's first output, (-1, -1)
    when none came: the step that admits it sends a fresh one before it runs (engine/sync_step.py, overlap.py)."""
    from asyncllm import SamplingParams
    from asyncllm.protocol import SchedulerStats

    await wait_idle(engine)
    observer = engine._replicas.replicas[0].observer
    heard: list[tuple[int, int] | None] = []  # None: an output; in the order the host's processor thread heard them
    on_output, on_stats = observer.on_output, observer.on_scheduler_stats

    def heard_output(*args: object) -> None:
        heard.append(None)
        on_output(*args)

    def heard_stats(stats: SchedulerStats, reporter: bool) -> None:
        heard.append((stats.num_requests_running, stats.num_requests_waiting))
        on_stats(stats, reporter)

    observer.on_output, observer.on_scheduler_stats = heard_output, heard_stats
    try:
        await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    finally:
        del observer.on_output, observer.on_scheduler_stats
    return next((s for s in reversed(heard[:heard.index(None)]) if s is not None), (-1, -1))


def random_prompts(num: int, seed: int, stem_len: int = 0, max_len: int = 70) -> list[list[int]]:
    """Seeded random token-id prompts; with `stem_len`, every other one starts with the same tokens (prefix hits)."""
    rng = random.Random(seed)
    stem = [rng.randrange(3, 500) for _ in range(stem_len)]
    prompts = []
    for i in range(num):
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(3, max_len - stem_len))]
        prompts.append(stem + tail if i % 2 else tail)
    return prompts


def token_prompts(count: int, seed: int, max_len: int = 60) -> list[list[int]]:
    """Seeded prompts of 3 to ``max_len`` token ids in 6..511 (a tiny checkpoint's ordinary tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(6, 512) for _ in range(rng.randint(3, max_len))] for _ in range(count)]


async def greedy_equals_transformers(path: str, prompts: list[list[int]], max_tokens: int,
                                     **engine_kwargs: object) -> AsyncEngine:
    """Run ``prompts`` at once through an engine on ``path`` (``engine_kwargs``): each one's greedy tokens equal
    transformers' ``generate``, EOS ignored. Returns the closed engine (its last stats)."""
    from asyncllm import SamplingParams
    from hf_reference import hf_greedy

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, **engine_kwargs) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, max_tokens, eos_token_id=None), f"{len(prompt)} tokens"
    return engine


async def assert_greedy_with_prefix_hit_equals_transformers(engine: AsyncEngine, path: str, seed: int) -> None:
    """Three prompts (37, 21, 12 tokens, past the tiny models' 8-token windows) at once, then the first one again
    with two more tokens (its first 32 tokens' blocks cached): each request's 10 greedy tokens equal transformers'
    ``generate``, and the prefix cache was hit."""
    from asyncllm import SamplingParams
    from hf_reference import hf_greedy

    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, 512) for _ in range(n)] for n in (37, 21, 12)]
    outs = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    again = await engine.generate(prompts[0] + [7, 8], greedy)
    assert engine.stats().prefix_cache_hits > 0
    for prompt, out in zip([*prompts, prompts[0] + [7, 8]], [*outs, again]):
        assert out.token_ids == hf_greedy(path, prompt, 10, eos_token_id=None), f"{len(prompt)} tokens"


CODE_PROMPTS = [  # code, as the bundled model was trained on; 22, 36, 65 and 13 tokens
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import numpy as np\n\nclass Matrix:\n    def __init__(self, rows, cols):\n        self.rows = rows",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i)\n",
]
"""Prompts for the bundled model (asyncllm.bundled): its accuracy tests score these."""


async def assert_chat_image_part_equals_transformers(engine: AsyncEngine, image: bytes, hf_greedy) -> None:
    """An OpenAI ``image_url`` chat part before a text part: prompt ids and 8 greedy tokens equal
    ``hf_greedy(None, [image], 8, messages=...)``'s (transformers' processor rendering ``{"type": "image"}``)."""
    from asyncllm import SamplingParams

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "what is this?"}]}]
    stream = engine.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}]
    hf_prompt, hf_tokens = hf_greedy(None, [image], 8, messages=hf_messages)
    assert stream.collector.prompt_token_ids == hf_prompt
    assert tokens == hf_tokens


async def assert_images_equal_transformers_then_hit_the_cache(engine: AsyncEngine, text: str, images: list[bytes],
                                                              hf_greedy) -> None:
    """A prompt with ``images``: prompt ids and 8 greedy tokens equal ``hf_greedy(text, images, 8)``'s; sent again,
    its prefix comes from the prefix cache and its tokens are the same."""
    from asyncllm import SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = {"prompt": text, "images": images}
    first = await engine.generate(prompt, greedy)
    expected = hf_greedy(text, images, 8)
    assert (first.prompt_token_ids, first.outputs[0].token_ids) == expected
    again = await engine.generate(prompt, greedy)
    assert again.outputs[0].token_ids == expected[1]
    assert again.num_cached_tokens > 0


async def assert_image_prompt_equals_transformers(path: str, text: str, images: list[bytes], hf_greedy,
                                                  **engine_kwargs: object) -> None:
    """One prompt with ``images`` through its own engine on ``path`` (``engine_kwargs``: two ranks, two stages, ...):
    prompt ids and 8 greedy tokens equal ``hf_greedy(text, images, 8)``'s."""
    from asyncllm import SamplingParams

    async with AsyncEngine(path, disable_log_stats=True, **engine_kwargs) as engine:
        out = await engine.generate({"prompt": text, "images": images}, SamplingParams(max_tokens=8, temperature=0.0))
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_greedy(text, images, 8)
