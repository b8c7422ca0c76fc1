"""transformers' continuous batching as the peer, inside a deadline.

``model.init_continuous_batching(generation_config=..., continuous_batching_config=...)``,
``manager.warmup()`` (the paged cache, and CUDA graphs where transformers uses
them: what ``generate_batch`` does first), ``manager.start()``, one
``manager.add_request(input_ids=..., request_id=..., max_new_tokens=...)`` per
request, results read with ``manager.get_result`` (not inside
``torch.inference_mode``, as transformers asks). The clock starts at the first
request, after the warm-up, as ours does.

The paged cache is sized for the workload on every device: twice the blocks
all requests need at once, so the scheduler's safety margin never holds a
prefill back, instead of transformers' default of 90% of free GPU memory, whose
attention-mask buffer (SDPA and eager read a mask as wide as the whole cache)
grows with it.

At the deadline the manager is hard-stopped (``manager.stop(hard_stop=True)``):
transformers then fails the unfinished requests and hands back their tokens so
far, which are counted, capped at what each asked for (5.23 has it). An older
``stop`` without ``hard_stop`` would wait for every request: the requests are
cancelled instead, and what comes back is usually only the finished ones; the
entry then says its tokens/s is a lower bound (``partial_tokens_counted`` false).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from typing import Any

from transformers.generation.configuration_utils import ContinuousBatchingConfig

from asyncllm.bench.hf_peer import generation_config, throughput_result
from asyncllm.bench.peer_clock import PROGRESS_EVERY_S, PeerClock
from asyncllm.bench.report import progress
from asyncllm.bench.requests import BenchRequest

__all__ = ["continuous_batching", "cb_config"]

_CPU_MAX_BATCH_TOKENS = 512
"""On a CPU, a small step keeps the attention mask (tokens x cache) cheap to fill."""


def cb_config(requests: list[BenchRequest], device_type: str, clock: PeerClock) -> ContinuousBatchingConfig:
    """A cache for the workload, room for every request in one batch; fields this transformers lacks are said.

    The page size (``page_size``, ``block_size`` before 5.17) is set too, so that
    the number of blocks means what it was computed for in every version.
    """
    fields = {f.name: f.default for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = next((name for name in ("page_size", "block_size") if name in fields), "page_size")
    page = fields.get(page_field) if isinstance(fields.get(page_field), int) else 256
    needed = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in requests)
    wanted: dict[str, Any] = {page_field: page, "num_blocks": 2 * needed + 1, "max_requests_per_batch": len(requests)}
    if device_type == "cpu":
        wanted["max_batch_tokens"] = _CPU_MAX_BATCH_TOKENS
    for name in sorted(set(wanted) - set(fields)):
        clock.say(f"continuous batching: this transformers has no ContinuousBatchingConfig.{name}; left to its default")
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})


def continuous_batching(
    model: Any, requests: list[BenchRequest], clock: PeerClock, deadline: float, show: bool
) -> dict[str, Any]:
    """All requests at once until they finish or ``deadline``: output tokens/s over what ran."""
    if time.perf_counter() >= deadline:
        clock.mark("continuous batching: the budget is spent before it starts")
        return throughput_result(requests, [0] * len(requests), 0.0)
    manager = _ready_manager(model, requests, clock)
    bar = progress(len(requests), "hf continuous", show)
    try:
        with clock.phase("continuous batching: start (background thread)"):
            manager.start()
        start = time.perf_counter()
        with clock.phase("continuous batching: run", requests=len(requests)) as record:
            for i, request in enumerate(requests):
                manager.add_request(input_ids=request.prompt_token_ids, request_id=f"r{i}",
                                    max_new_tokens=request.output_len)
            done = _collect(manager, requests, deadline, clock, bar)
            record.update(finished=len(done), **_resolved(manager))
        elapsed, partial = _stop(manager, requests, len(done) < len(requests), start, clock)
    finally:
        if manager.is_running():  # an error above: never wait for the unfinished requests
            _halt(manager, requests)
        bar.close()
    result = throughput_result(requests, [done.get(i, partial.get(i, 0)) for i in range(len(requests))], elapsed)
    if result["cut"]:
        result["partial_tokens_counted"] = len(done) + len(partial.keys() - done.keys()) == len(requests)
        if not result["partial_tokens_counted"]:
            result["completed"] += "; unfinished requests not counted: tokens/s is a lower bound"
    return result


def _ready_manager(model: Any, requests: list[BenchRequest], clock: PeerClock) -> Any:
    config = cb_config(requests, model.device.type, clock)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    longest = max(r.output_len for r in requests)
    with clock.phase("continuous batching: manager init", num_blocks=getattr(config, "num_blocks", None)) as record:
        manager = model.init_continuous_batching(generation_config=generation_config(longest),
                                                 continuous_batching_config=config)
        record["attn_implementation"] = model.config._attn_implementation
    if hasattr(manager, "warmup"):
        with clock.phase("continuous batching: warm-up (paged cache; CUDA graphs if used)") as record:
            manager.warmup()
            record.update(_resolved(manager))
    return manager


def _resolved(manager: Any) -> dict[str, Any]:
    """What transformers decided (sizes, graphs, async batching), for the log and the JSON."""
    config = getattr(manager, "continuous_batching_config", None)
    names = ("num_blocks", "max_batch_tokens", "max_requests_per_batch", "use_cuda_graph", "use_async_batching")
    return {name: str(getattr(config, name)) for name in names if hasattr(config, name)}


def _collect(
    manager: Any, requests: list[BenchRequest], deadline: float, clock: PeerClock, bar: Any
) -> dict[int, int]:
    """Finished requests (index -> tokens) until all are or ``deadline`` passes."""
    done: dict[int, int] = {}
    next_report = time.perf_counter() + PROGRESS_EVERY_S
    while len(done) < len(requests) and (left := deadline - time.perf_counter()) > 0:
        result = manager.get_result(timeout=min(left, 1.0))
        if time.perf_counter() >= next_report:
            clock.say(f"continuous batching: {len(done)}/{len(requests)} requests finished")
            next_report = time.perf_counter() + PROGRESS_EVERY_S
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers' continuous batching stopped after {len(done)}/{len(requests)} "
                                   "requests")
            continue
        index = int(result.request_id.removeprefix("r"))
        if not result.is_finished() or index in done:
            continue
        if result.error:
            raise RuntimeError(f"transformers' continuous batching failed {result.request_id}: {result.error}")
        done[index] = _checked(result, requests[index])
        if len(done) == 1:
            clock.mark("continuous batching: first request finished", request=result.request_id)
        bar.update(1)
    return done


def _checked(result: Any, request: BenchRequest) -> int:
    if len(result.generated_tokens) != request.output_len:
        raise RuntimeError(f"transformers' continuous batching generated {len(result.generated_tokens)} tokens "
                           f"for {result.request_id}, {request.output_len} were requested")
    return request.output_len


def _stop(
    manager: Any, requests: list[BenchRequest], cut: bool, start: float, clock: PeerClock
) -> tuple[float, dict[int, int]]:
    """(seconds from ``start`` to the stop, the tokens so far of the requests a cut run hands back)."""
    if not cut:
        elapsed = time.perf_counter() - start
        with clock.phase("continuous batching: stop"):
            manager.stop(block=True)
        return elapsed, {}
    with clock.phase("continuous batching: stop at the deadline", hard_stop=_has_hard_stop(manager)) as record:
        _halt(manager, requests)
        elapsed = time.perf_counter() - start
        partial = _handed_back(manager, requests)
        record["requests_handed_back"] = len(partial)
    return elapsed, partial


def _has_hard_stop(manager: Any) -> bool:
    return "hard_stop" in inspect.signature(manager.stop).parameters


def _halt(manager: Any, requests: list[BenchRequest]) -> None:
    """Stops the manager now, unfinished requests or not."""
    if _has_hard_stop(manager):
        manager.stop(block=True, hard_stop=True)
    else:
        for i in range(len(requests)):
            manager.cancel_request(f"r{i}")
        manager.stop(block=True, timeout=60)


def _handed_back(manager: Any, requests: list[BenchRequest]) -> dict[int, int]:
    """After a hard stop: the requests' tokens so far (index -> tokens, capped at what each asked for)."""
    partial: dict[int, int] = {}
    while (result := manager.get_result(timeout=0.1)) is not None:
        index = int(result.request_id.removeprefix("r"))
        partial[index] = min(len(result.generated_tokens), requests[index].output_len)
    return partial
