"""transformers as the peer, on the same requests, in the same process (after our engine has closed).

- static batching: ``model.generate`` on left-padded batches of 64 in submission
  order; each batch runs to its longest request; only requested tokens count.
- continuous batching: ``model.init_continuous_batching``, ``manager.start()``,
  ``manager.add_request(...)`` per request (``hf_continuous.py``).
- latency: batch-1 ``generate``; TTFT is a 1-token generate, decode tokens/s
  the extra tokens of a full generate over its extra time.

``generate`` keeps transformers' defaults (dynamic cache, the attention
implementation ``from_config`` picks, no ``torch.compile``): a static cache
with compile would be a stronger peer, but its compilation alone does not fit
a device call. Shape presets get transformers' own random initialisation
(dummy weights, like ours); EOS is disabled so every request generates exactly
what it asked for.

Everything runs under a time budget (``--compare-time-budget``, `PeerClock`):
static batching may use half of what is left after the model is built and
warmed up, continuous batching the rest. A phase cut by its deadline reports
what it completed, flagged ``cut``; one that fails reports its error; neither
stops the run, which still prints our own numbers.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from asyncllm.bench.common import BenchContext
from asyncllm.bench.peer_clock import PROGRESS_EVERY_S, PeerClock
from asyncllm.bench.report import progress
from asyncllm.bench.requests import BenchRequest, total_tokens
from asyncllm.bench.roofline import sync_device

__all__ = ["load_hf_model", "static_batching", "throughput_peers", "latency_peer", "throughput_result",
           "generation_config"]

_PAD_ID = 0
STATIC_SHARE = 0.5
"""Static batching's share of the budget left once the model is built and warmed up."""


def load_hf_model(ctx: BenchContext, clock: PeerClock) -> Any:
    """The transformers model of the benchmark's checkpoint (random weights for dummy presets), in eval mode."""
    if ctx.model.load_format == "dummy":
        model = _dummy_model(ctx, clock)
    else:
        with clock.phase("model load (from_pretrained, on the CPU)"):
            model = AutoModelForCausalLM.from_pretrained(ctx.model.path, dtype=ctx.dtype)
        with clock.phase("move to the device", device=str(ctx.device)):
            model.to(ctx.device)
            sync_device(ctx.device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = _PAD_ID
    return model.eval()


def _dummy_model(ctx: BenchContext, clock: PeerClock) -> Any:
    """Built on the meta device, then storage on the device and one pass of transformers' ``init_weights``.

    ``from_config`` on a real device initialises every linear layer twice (torch's
    default init, then transformers'): 10-14 s for Qwen3-0.6B on a 2-core CPU
    against about 5 s this way (on a GPU both take well under a second).
    ``to_empty`` leaves garbage and unties tied weights: the weights are tied
    again, and each tensor's first element is set to NaN before the init and
    checked after it (transformers initialises whole tensors). Should a
    transformers version skip a tensor, the model is built the plain way instead.
    """
    config = AutoConfig.from_pretrained(ctx.model.path)
    with clock.phase("model build (meta device)"), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=ctx.dtype)
    with clock.phase("storage on the device (to_empty)", device=str(ctx.device)):
        model.to_empty(device=ctx.device)
        model.tie_weights()
    with clock.phase("random init (transformers' init_weights)") as record:
        skipped = _init_weights(model, ctx.args.seed)
        record["skipped"] = len(skipped)
    if not skipped:
        return model
    clock.say(f"init_weights skipped {skipped[:3]}...: building the model on the device instead")
    with clock.phase("model build on the device (from_config)", device=str(ctx.device)), torch.device(ctx.device):
        return AutoModelForCausalLM.from_config(config, dtype=ctx.dtype)


def _init_weights(model: Any, seed: int) -> list[str]:
    """transformers' random init over the garbage of ``to_empty``; returns the tensors it did not touch."""
    named = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()]
    with torch.no_grad():
        for _, tensor in named:
            tensor.view(-1)[0] = float("nan")
        torch.manual_seed(seed)
        model.init_weights()
        firsts = torch.stack([tensor.view(-1)[0].float() for _, tensor in named]).isfinite().tolist()
    return [name for (name, _), finite in zip(named, firsts) if not finite]


def generation_config(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=_PAD_ID)


class _Deadline(StoppingCriteria):
    """Ends ``generate`` for every row at ``deadline``, and says every 30 s how many tokens it has."""

    def __init__(self, deadline: float, clock: PeerClock, what: str, max_new_tokens: int) -> None:
        self.deadline, self.clock, self.what, self.max_new_tokens = deadline, clock, what, max_new_tokens
        self.tokens = 0
        self.next_report = time.perf_counter() + PROGRESS_EVERY_S

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.tokens += 1
        now = time.perf_counter()
        if now >= self.next_report:
            self.clock.say(f"{self.what}: {self.tokens}/{self.max_new_tokens} tokens")
            self.next_report = now + PROGRESS_EVERY_S
        return torch.full((input_ids.shape[0],), now >= self.deadline, dtype=torch.bool, device=input_ids.device)


def _generate(model: Any, requests: list[BenchRequest], max_new_tokens: int, stop: _Deadline | None = None) -> int:
    """One left-padded greedy ``generate``; returns the new tokens per row (fewer when ``stop`` cut it)."""
    ids, mask = _left_padded(requests, model.device)
    criteria = {"stopping_criteria": StoppingCriteriaList([stop])} if stop else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=generation_config(max_new_tokens), **criteria)
    return out.shape[1] - ids.shape[1]


def _left_padded(requests: list[BenchRequest], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), width), _PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        n = len(request.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(request.prompt_token_ids)
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


def static_batching(
    model: Any, requests: list[BenchRequest], batch_size: int, clock: PeerClock, deadline: float, show: bool
) -> dict[str, Any]:
    """``generate`` batch by batch until ``deadline``: tokens/s over the batches completed.

    No batch starts past the deadline; the one running then is cut and left out,
    unless it is the first, whose tokens so far are then what is reported.
    """
    bar = progress(len(requests), "hf static", show)
    starts = range(0, len(requests), batch_size)
    done = [0] * len(requests)
    completed_s = 0.0
    for number, first in enumerate(starts, 1):
        if time.perf_counter() >= deadline:
            clock.mark("static batching: its share of the budget is spent", batches_not_started=len(starts) - number + 1)
            break
        batch = requests[first : first + batch_size]
        name = f"static batch {number}/{len(starts)}"
        tokens, seconds = _static_batch(model, batch, name, clock, deadline)
        if tokens < max(r.output_len for r in batch):
            if number == 1:
                clock.mark("static batching: the first batch did not finish inside its share", new_tokens=tokens)
                done[: len(batch)] = [min(r.output_len, tokens) for r in batch]
                completed_s = seconds
            break
        done[first : first + len(batch)] = [r.output_len for r in batch]
        completed_s += seconds
        bar.update(len(batch))
    bar.close()
    return throughput_result(requests, done, completed_s)


def _static_batch(model: Any, batch: list[BenchRequest], name: str, clock: PeerClock, deadline: float) -> tuple[int, float]:
    """One batch to its longest request (or the deadline): (new tokens per row, seconds)."""
    longest = max(r.output_len for r in batch)
    with clock.phase(name, requests=len(batch), longest_output=longest) as record:
        sync_device(model.device)
        start = time.perf_counter()
        tokens = _generate(model, batch, longest, _Deadline(deadline, clock, name, longest))
        sync_device(model.device)
        seconds = time.perf_counter() - start
        record["new_tokens"] = tokens
    return tokens, seconds


def throughput_result(requests: list[BenchRequest], done: list[int], elapsed: float) -> dict[str, Any]:
    """The peer's entry: ``done[i]`` is how many of its requested tokens request i got in ``elapsed`` seconds.

    A cut run (some request short of its tokens) reports output tokens/s over what
    ran and no total tokens/s (which prompts were prefilled is not known).
    """
    prompt_tokens, _ = total_tokens(requests)
    output_tokens = sum(done)
    completed = sum(n == r.output_len for r, n in zip(requests, done))
    cut = completed < len(requests)
    result: dict[str, Any] = {
        "num_requests": len(requests),
        "num_requests_completed": completed,
        "cut": cut,
        "completed": f"{completed}/{len(requests)}" + (", cut by the time budget" if cut else ""),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else 0.0,
    }
    if not cut:
        result["total_tokens_per_s"] = (prompt_tokens + output_tokens) / elapsed
    return result


def _ready_model(ctx: BenchContext, requests: list[BenchRequest], clock: PeerClock) -> Any:
    """The model, after one short batch: transformers' first ``generate`` pays its lazy set-up (seconds)."""
    model = load_hf_model(ctx, clock)
    with clock.phase("warm-up generate", requests=len(requests[:2]), new_tokens=2):
        _generate(model, requests[:2], 2)
        sync_device(model.device)
    return model


def _guarded(clock: PeerClock, what: str, run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)``, or its error as the peer's entry: one failed peer must not lose the others or our numbers."""
    first = len(clock.records)
    try:
        result = run(*args)
    except Exception as exc:  # noqa: BLE001 -- reported on stderr with its traceback, and in the JSON
        result = {"error": clock.failed(what, exc)}
    result["phases"] = clock.records[first:]
    return result


def throughput_peers(
    ctx: BenchContext, requests: list[BenchRequest], batch_size: int, budget_s: float
) -> dict[str, dict[str, Any]]:
    """Static then continuous batching under one time budget; each entry lists its phases (set-up phases first)."""
    from asyncllm.bench.hf_continuous import continuous_batching

    clock = PeerClock(budget_s)
    clock.say(f"transformers on {len(requests)} requests, time budget {budget_s:.0f}s")
    prepared = _guarded(clock, "the transformers model", lambda: {"model": _ready_model(ctx, requests, clock)})
    model = prepared.pop("model", None)
    if model is None:
        return {name: dict(prepared) for name in ("hf_static", "hf_continuous")}
    setup_phases = list(clock.records)
    static = _guarded(clock, "static batching", static_batching, model, requests, batch_size, clock,
                      clock.share(STATIC_SHARE), ctx.show_progress)
    continuous = _guarded(clock, "continuous batching", continuous_batching, model, requests, clock,
                          clock.deadline, ctx.show_progress)
    model = None
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    for peer in (static, continuous):
        peer["phases"] = setup_phases + peer["phases"]
    return {"hf_static": static, "hf_continuous": continuous}


def latency_peer(ctx: BenchContext, request: BenchRequest, budget_s: float) -> dict[str, dict[str, Any]]:
    """Batch-1 ``generate``: TTFT and decode tokens/s; a decode cut by the budget is measured over what ran."""
    clock = PeerClock(budget_s)
    clock.say(f"transformers batch-1 generate of {request.output_len} tokens, time budget {budget_s:.0f}s")
    return {"hf_generate": _guarded(clock, "the latency peer", _latency, ctx, request, clock)}


def _latency(ctx: BenchContext, request: BenchRequest, clock: PeerClock) -> dict[str, Any]:
    model = _ready_model(ctx, [request], clock)

    def timed(name: str, new_tokens: int) -> tuple[float, int]:
        with clock.phase(name, new_tokens=new_tokens) as record:
            sync_device(ctx.device)
            start = time.perf_counter()
            tokens = _generate(model, [request], new_tokens, _Deadline(clock.deadline, clock, name, new_tokens))
            sync_device(ctx.device)
            seconds = time.perf_counter() - start
            record["generated"] = tokens
        return seconds, tokens

    ttft, _ = timed("generate: TTFT", 1)
    total, tokens = timed("generate: decode", request.output_len)
    cut = tokens < request.output_len
    decode = (tokens - 1) / (total - ttft) if tokens > 1 and total > ttft else 0.0
    return {
        "ttft_s": ttft, "decode_tokens_per_s": decode, "elapsed_s": total, "output_tokens": tokens, "cut": cut,
        "completed": f"{tokens}/{request.output_len} tokens" + (", cut by the time budget" if cut else ""),
    }
