"""`AsyncEngine.generate_many`: a batch job over many prompts, results in input order.

A fixed pool of worker tasks takes prompts in order from one shared iterator,
so at most `max_concurrency` requests are in flight (memory stays bounded for a
million prompts) while the scheduler always has enough waiting requests to
fill its batches. A single prompt (a str, a prompt dict or a flat list of token
ids) is a batch of one, as vLLM's ``LLM.generate`` reads it. The batch is one
admission group (`asyncllm.engine.admission.admission_group`): an idle engine
takes it whatever its queue limits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from asyncllm.config_checks import is_int
from asyncllm.engine.admission import admission_group
from asyncllm.errors import InvalidRequestError, running_asyncio_loop
from asyncllm.lora import LoRARequest
from asyncllm.sampling import SamplingParams

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.outputs import RequestOutput

__all__ = ["generate_many"]


async def generate_many(engine: AsyncEngine, prompts: Iterable[Any], params: Any = None, *,
                        progress: bool = False, max_concurrency: int | None = None,
                        lora_request: Any = None) -> list[RequestOutput]:
    running_asyncio_loop()  # under trio: EventLoopError, before any task is made
    prompts = _as_batch(prompts)
    per_prompt = _per_prompt("params", params, SamplingParams, len(prompts))
    loras = _per_prompt("lora_request", lora_request, LoRARequest, len(prompts))
    # a bad one refuses the batch before any prompt runs, as vLLM's LLM.generate (the tokenizer's checks: per request)
    for each in {id(p): p for p in per_prompt if isinstance(p, SamplingParams)}.values():
        each.validate()
    limit = _concurrency(engine, max_concurrency)
    results: list[RequestOutput | None] = [None] * len(prompts)
    indices = iter(range(len(prompts)))
    bar = _progress_bar(len(prompts)) if progress else None

    async def worker() -> None:
        for i in indices:  # the shared iterator hands each index to exactly one worker
            options = {} if loras[i] is None else {"lora_request": loras[i]}
            results[i] = await engine.generate(prompts[i], per_prompt[i], **options)
            if bar is not None:
                bar.update(1)

    num_workers = min(limit, len(prompts))
    with admission_group(num_workers):  # the batch is admitted together: its workers' tasks inherit the group
        tasks = [asyncio.ensure_future(worker()) for _ in range(num_workers)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # their streams abort their requests as they unwind
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value] - every slot is filled once gather returns


def _as_batch(prompts: Any) -> list[Any]:
    """The prompts of the batch: a str or a prompt dict is a batch of one, as vLLM's ``LLM.generate`` reads it (never
    a str's characters); so is a flat list of token ids (vLLM's ``parse_and_batch_prompt``: an int is no prompt)."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise InvalidRequestError("prompts", f"must be a prompt or an iterable of prompts, got "
                                             f"{type(prompts).__name__}")
    return list(prompts)


def _is_token_ids(prompts: Any) -> bool:
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(is_int(t) for t in prompts)


def _per_prompt(field: str, value: Any, kind: type, count: int) -> list[Any]:
    """One value for every prompt, or a list with one per prompt (each a `kind` or None, checked before any prompt
    runs: a bad one at the end of a long batch would fail it after the rest ran)."""
    if value is None or isinstance(value, kind):
        return [value] * count
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidRequestError(field, f"got {len(value)} {kind.__name__}s for {count} prompts")
        for index, each in enumerate(value):
            if each is not None and not isinstance(each, kind):
                raise InvalidRequestError(field, f"must be a {kind.__name__} or None per prompt, got "
                                                 f"{type(each).__name__} for prompt {index}")
        return list(value)
    raise InvalidRequestError(field, f"must be a {kind.__name__} or a list of them, got {type(value).__name__}")


def _concurrency(engine: AsyncEngine, max_concurrency: int | None) -> int:
    if max_concurrency is None:
        return 2 * engine.config.max_num_seqs
    if not is_int(max_concurrency) or max_concurrency < 1:
        raise InvalidRequestError("max_concurrency", f"must be a positive int, got {max_concurrency!r}")
    return max_concurrency


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate_many", unit="req", dynamic_ncols=True)
