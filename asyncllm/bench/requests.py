"""Seeded synthetic requests: token-id prompts and the number of tokens each must generate.

Prompts are random token ids (no two share a prefix, so the prefix cache
never helps), and every request ignores EOS, so each engine does exactly the
same work. ``sharegpt_like`` draws lengths from log-normal distributions with
the medians and spread of ShareGPT conversations (prompts ~ 200 tokens,
replies ~ 150, long tails), clipped to the model length.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["BenchRequest", "uniform_requests", "sharegpt_like_requests", "fixed_requests", "total_tokens",
           "longest_request", "check_output_tokens", "decode_shape"]

_FIRST_ID = 10
"""Prompt ids start past the low ids where special tokens usually sit."""


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_ID, vocab_size) for _ in range(length)]


def uniform_requests(
    num_requests: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int], vocab_size: int, seed: int
) -> list[BenchRequest]:
    """Input and output lengths each uniform in their inclusive range (the nano-vllm workload)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        input_len = rng.randint(*input_len_range)
        output_len = rng.randint(*output_len_range)
        requests.append(BenchRequest(_prompt(rng, input_len, vocab_size), output_len))
    return requests


def fixed_requests(
    num_requests: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_prompt(rng, input_len, vocab_size), output_len) for _ in range(num_requests)]


def _lognormal_len(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal draw clipped to [lo, hi]; a cap `hi` below `lo` wins (``--max-output-len 1``: one token)."""
    return max(min(lo, hi), min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def sharegpt_like_requests(
    num_requests: int, vocab_size: int, seed: int, max_input_len: int = 2048, max_output_len: int = 1024,
    input_median: float = 200.0, output_median: float = 150.0,
) -> list[BenchRequest]:
    """Lengths with ShareGPT's shape: log-normal (sigma 1.0 for prompts, 0.9 for replies), clipped."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        input_len = _lognormal_len(rng, input_median, 1.0, 4, max_input_len)
        output_len = _lognormal_len(rng, output_median, 0.9, 4, max_output_len)
        requests.append(BenchRequest(_prompt(rng, input_len, vocab_size), output_len))
    return requests


def total_tokens(requests: list[BenchRequest]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of a workload."""
    return sum(len(r.prompt_token_ids) for r in requests), sum(r.output_len for r in requests)


def longest_request(requests: list[BenchRequest]) -> int:
    """The most tokens (prompt + output) one request of the workload needs: the engine's max_model_len must hold it."""
    return max(len(r.prompt_token_ids) + r.output_len for r in requests)


def check_output_tokens(requests: list[BenchRequest], generated: int) -> None:
    """`RuntimeError` when the engine generated other than the workload's requested output tokens."""
    requested = total_tokens(requests)[1]
    if generated != requested:
        raise RuntimeError(f"the engine generated {generated} tokens, {requested} were requested")


def decode_shape(requests: list[BenchRequest], max_num_seqs: int) -> tuple[float, float]:
    """(mean decode batch, mean context per output token) of the fastest schedule of ``requests``: the roofline's
    batch and context (docs/benchmarks.md, "The decode roofline").

    A step reads the weights once, however many requests it decodes, and at least ``max(longest output,
    output tokens / max_num_seqs)`` steps are needed: the mean batch is the output tokens over those steps. Each
    output token reads its request's context at that point (the prompt and the tokens before it), whatever the
    schedule: the mean context weights each request by its output tokens."""
    outputs = sum(r.output_len for r in requests)
    steps = max(max(r.output_len for r in requests), math.ceil(outputs / max_num_seqs))
    context = sum(r.output_len * (len(r.prompt_token_ids) + r.output_len / 2) for r in requests) / outputs
    return outputs / steps, context
