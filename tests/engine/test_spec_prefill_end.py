"""Speculative decoding where a chunked prefill leaves exactly one prompt token for its last step.

That step's request has one token to compute, as a decode has, so the scheduler gives it drafts there
(asyncllm/sched/schedule_each.py; vLLM drafts only after the prefill sampled a token). The step computes the last
prompt token and the drafts as one chunk, as a drafted decode step does; what must hold is that nothing a request
returns changes: greedy tokens, their logprobs, and exactly one prompt-logprobs row per prompt position (None for
the first) with the values of an engine without drafts, over many prompt lengths and token budgets (9 tokens under
a budget of 8 leaves one, as do 17 and 25), for the n-gram proposer (a draft model has no proposal for a request
that sampled nothing, so it drafts only once the prefill sampled).
"""

from __future__ import annotations

import asyncio
import random

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.bundled import bundled_model_path

BUDGETS = (5, 8)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def _prompts() -> list[list[int]]:
    rnd = random.Random(2)
    stem = [rnd.randrange(3, 300) for _ in range(5)]  # repeated: the n-gram proposer finds drafts in the prompt
    return [(stem * 6)[:n] for n in range(3, 27)] + [[rnd.randrange(3, 300) for _ in range(n)] for n in (9, 17)]


def _same_rows(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        (g is None and w is None) or (g is not None and w is not None and g.keys() == w.keys()
                                      and all(abs(g[t].logprob - w[t].logprob) < 2e-4 and g[t].rank == w[t].rank
                                              for t in g))
        for g, w in zip(got, want))


async def _run(budget: int, prompts: list[list[int]], spec: dict | None) -> tuple[list, int]:
    async with AsyncEngine(bundled_model_path(), disable_log_stats=True, max_num_batched_tokens=budget,
                           max_num_seqs=4, speculative_config=spec) as engine:
        outs = await asyncio.gather(*(engine.generate(p, PARAMS) for p in prompts))
        return outs, engine.stats().spec_decode_num_accepted_tokens


async def test_a_prefill_ending_in_a_one_token_step_returns_what_it_returns_without_drafts() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = _prompts()
    for budget in BUDGETS:
        want, _ = await _run(budget, prompts, None)
        got, accepted = await _run(budget, prompts, spec)
        assert accepted > 0
        for prompt, g, w in zip(prompts, got, want):
            where = f"{len(prompt)}-token prompt, budget {budget}"
            assert g.token_ids == w.token_ids, where
            assert _same_rows(g.logprobs, w.logprobs), where
            assert len(g.prompt_logprobs) == len(prompt) and g.prompt_logprobs[0] is None, where
            assert _same_rows(g.prompt_logprobs, w.prompt_logprobs), where
