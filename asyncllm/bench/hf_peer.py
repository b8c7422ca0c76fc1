"""transformers as the peer, on the same requests, in the same process (after our engine has closed).

- static batching: ``model.generate`` on left-padded batches of 64 in submission
  order; each batch runs to its longest request; only requested tokens count.
- continuous batching: ``model.init_continuous_batching(generation_config=...)``,
  ``manager.start()``, ``manager.add_request(...)`` per request, results read by
  iterating the manager (not inside ``torch.inference_mode``, as transformers asks).
- latency: batch-1 ``generate``; TTFT is a 1-token generate, decode tokens/s
  the extra tokens of a full generate over its extra time.

Shape presets get transformers' own random initialisation (dummy weights, like
ours); EOS is disabled so every request generates exactly what it asked for.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from asyncllm.bench.common import BenchContext
from asyncllm.bench.report import progress
from asyncllm.bench.requests import BenchRequest, total_tokens

__all__ = ["load_hf_model", "static_batching", "continuous_batching", "throughput_peers", "latency_peer"]

_PAD_ID = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf_model(ctx: BenchContext) -> Any:
    """The transformers model of the benchmark's checkpoint (random weights for dummy presets), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if ctx.model.load_format == "dummy":
        config = AutoConfig.from_pretrained(ctx.model.path)
        with torch.device(ctx.device):
            model = AutoModelForCausalLM.from_config(config, dtype=ctx.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(ctx.model.path, dtype=ctx.dtype).to(ctx.device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = _PAD_ID
    return model.eval()


def _generation_config(max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=_PAD_ID)


def _left_padded(requests: list[BenchRequest], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), width), _PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        n = len(request.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(request.prompt_token_ids)
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


def static_batching(model: Any, requests: list[BenchRequest], batch_size: int, show: bool) -> dict[str, Any]:
    """``generate`` batch by batch; returns elapsed time and tokens/s of the requested tokens."""
    device = model.device
    bar = progress(len(requests), "hf static", show)
    _sync(device)
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        ids, mask = _left_padded(batch, device)
        longest = max(r.output_len for r in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=_generation_config(longest))
        bar.update(len(batch))
    _sync(device)
    bar.close()
    return _throughput(requests, time.perf_counter() - start)


def _cb_config(requests: list[BenchRequest], device: torch.device) -> Any:
    """On a CPU, a cache sized for the workload (transformers would size it from memory, slowly); else its default."""
    if device.type == "cuda":
        return None
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in requests) + 1
    return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=512)


def continuous_batching(model: Any, requests: list[BenchRequest], show: bool) -> dict[str, Any]:
    """transformers' continuous batching manager over all requests at once."""
    longest = max(r.output_len for r in requests)
    config = _cb_config(requests, model.device)
    kwargs = {} if config is None else {"continuous_batching_config": config}
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    manager = model.init_continuous_batching(generation_config=_generation_config(longest), **kwargs)
    bar = progress(len(requests), "hf continuous", show)
    start = time.perf_counter()
    manager.start()
    try:
        for i, request in enumerate(requests):
            manager.add_request(
                input_ids=request.prompt_token_ids, request_id=f"r{i}", max_new_tokens=request.output_len
            )
        generated = _collect(manager, len(requests), bar)
    finally:
        manager.stop(block=True)
        bar.close()
    elapsed = time.perf_counter() - start
    expected = total_tokens(requests)[1]
    if generated != expected:
        raise RuntimeError(f"transformers' continuous batching generated {generated} tokens, {expected} were requested")
    return _throughput(requests, elapsed)


def _collect(manager: Any, num_requests: int, bar: Any) -> int:
    finished: set[str] = set()
    generated = 0
    for result in manager:
        if result.is_finished() and result.request_id not in finished:
            if result.error:
                raise RuntimeError(f"transformers' continuous batching failed {result.request_id}: {result.error}")
            finished.add(result.request_id)
            generated += len(result.generated_tokens)
            bar.update(1)
            if len(finished) == num_requests:
                break
    if len(finished) != num_requests:
        raise RuntimeError(f"transformers' continuous batching stopped after {len(finished)}/{num_requests} requests")
    return generated


def _throughput(requests: list[BenchRequest], elapsed: float) -> dict[str, Any]:
    prompt_tokens, output_tokens = total_tokens(requests)
    return {
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }


def _warm_up(model: Any, requests: list[BenchRequest]) -> None:
    """One short batch first: transformers' first ``generate`` pays its lazy set-up (seconds)."""
    ids, mask = _left_padded(requests[:2], model.device)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, generation_config=_generation_config(2))


def throughput_peers(ctx: BenchContext, requests: list[BenchRequest], batch_size: int) -> dict[str, dict[str, Any]]:
    model = load_hf_model(ctx)
    _warm_up(model, requests)
    try:
        return {
            "hf_static": static_batching(model, requests, batch_size, ctx.show_progress),
            "hf_continuous": continuous_batching(model, requests, ctx.show_progress),
        }
    finally:
        del model
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


def latency_peer(ctx: BenchContext, request: BenchRequest) -> dict[str, dict[str, Any]]:
    """Batch-1 ``generate``: TTFT and decode tokens/s."""
    model = load_hf_model(ctx)
    ids, mask = _left_padded([request], ctx.device)

    def timed(new_tokens: int) -> float:
        _sync(ctx.device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=_generation_config(new_tokens))
        _sync(ctx.device)
        return time.perf_counter() - start

    _warm_up(model, [request])
    ttft = timed(1)
    total = timed(request.output_len)
    decode = (request.output_len - 1) / max(total - ttft, 1e-9)
    return {"hf_generate": {"ttft_s": ttft, "decode_tokens_per_s": decode, "elapsed_s": total}}
