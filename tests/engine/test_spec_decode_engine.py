"""Speculative decoding end to end: drafts change how many steps a request takes, never its tokens.

Greedy outputs equal transformers' with drafts under chunked prefill, a small
step budget, preemption (recompute and swap) and tensor parallelism; on the bundled model (trained
on Python source, so its outputs repeat and drafts are often right) outputs
equal those of an engine without drafts, for greedy and seeded sampling and
next to requests that are not drafted, and the accepted drafts are exactly
those an n-gram proposer over the final tokens accepts.
"""

from __future__ import annotations

import asyncio
import functools
import json

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams, StructuredOutputs
from asyncllm.bundled import bundled_model_path
from asyncllm.spec.config import SpeculativeConfig
from asyncllm.spec.ngram import NgramProposer
from engine_helpers import random_prompts, snapshot_before_first_output
from hf_reference import hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 24
CODE = [
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
    "import os\nimport sys\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument(",
    "    def test_one(self):\n        self.assertEqual(f(1), 1)\n\n    def test_two(self):\n        self.assertEqual(",
    "for name in names:\n    if name.startswith('_'):\n        continue\n    print(name)\nfor name in",
]


@functools.lru_cache(maxsize=None)
def _reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), MAX_TOKENS)


CASES = {
    "default": {},
    "recompute-small-budget": {"num_gpu_blocks_override": 12, "max_model_len": 128, "max_num_batched_tokens": 16},
    "swap": {"num_gpu_blocks_override": 12, "max_model_len": 128, "preemption_mode": "swap", "swap_space": 0.001},
    "tp2": {"tensor_parallel_size": 2},
}


@pytest.mark.parametrize("case", list(CASES))
async def test_greedy_output_equals_transformers_with_drafts(tiny_llama: str, case: str) -> None:
    prompts = random_prompts(10, seed=3, stem_len=32)
    prompts += [[5, 6, 7, 8, 9] * 6, list(range(10, 30)) * 3]  # drafts from the prompt
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    async with AsyncEngine(tiny_llama, disable_log_stats=True, speculative_config=SPEC, **CASES[case]) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        stats = engine.stats()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _reference(tiny_llama, tuple(prompt)), f"prompt of {len(prompt)} tokens diverged"
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    if case in ("recompute-small-budget", "swap"):
        assert stats.num_preemptions_total > 0


def _expected_acceptance(prompt: list[int], output: list[int], max_tokens: int) -> tuple[int, int, int]:
    """(drafted steps, drafts, accepted drafts) of one request decoded alone with SPEC, from its final tokens."""
    proposer, buffer = NgramProposer(SpeculativeConfig.from_dict(SPEC)), bytearray()
    tokens, n, steps, drafted, accepted = prompt + output[:1], 1, 0, 0, 0
    while n < len(output):
        drafts = proposer.propose(tokens, buffer, max_tokens - n - 1)
        m = 0
        while m < len(drafts) and drafts[m] == output[n + m]:
            m += 1
        steps, drafted, accepted = steps + bool(drafts), drafted + len(drafts), accepted + m
        tokens += output[n : n + m + 1]
        n += m + 1
    return steps, drafted, accepted


async def _generate(engine: AsyncEngine, prompts: list, params: list[SamplingParams]) -> list:
    return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bundled_engines():
    """The bundled model without and with drafts, shared by the tests below (each reads stats as differences)."""
    path = bundled_model_path()
    compact = {"structured_output_disable_any_whitespace": True}  # the random model would write whitespace on and on
    async with AsyncEngine(path, disable_log_stats=True, **compact) as base, \
            AsyncEngine(path, disable_log_stats=True, speculative_config=SPEC, **compact) as drafting:
        yield base, drafting


def _spec_counts(engine: AsyncEngine) -> tuple[int, int, int]:
    stats = engine.stats()
    return stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


@pytest.mark.asyncio(loop_scope="module")
async def test_the_bundled_model_accepts_drafts_without_changing_a_token(bundled_engines) -> None:
    base_engine, engine = bundled_engines
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    params = [greedy] * len(CODE)
    params += [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=48, ignore_eos=True) for i in range(4)]
    penalized = [SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=1.2),
                 SamplingParams(temperature=0.0, max_tokens=48, presence_penalty=0.5, frequency_penalty=0.3,
                                min_tokens=30),
                 SamplingParams(temperature=0.7, seed=5, max_tokens=48, repetition_penalty=1.1),
                 SamplingParams(temperature=0.0, max_tokens=48, prompt_logprobs=1)]
    params += penalized + [SamplingParams(temperature=0.0, max_tokens=48, logit_bias={13: 3.0}),
                           SamplingParams(temperature=0.0, max_tokens=48, allowed_token_ids=list(range(300))),
                           SamplingParams(temperature=0.0, max_tokens=48, logprobs=2)]
    prompts = (CODE * 4)[: len(params)]
    assert len(prompts) == len(params)
    base = await _generate(base_engine, prompts, params)
    before, per_pos_before = _spec_counts(engine), list(engine.stats().spec_decode_accepted_per_pos)
    greedy_alone = [await engine.generate(p, greedy) for p in CODE]  # one at a time: acceptance is exact
    counts = tuple(after - was for after, was in zip(_spec_counts(engine), before))
    per_pos = [after - was for after, was in zip(engine.stats().spec_decode_accepted_per_pos, per_pos_before)]
    drafted = await _generate(engine, prompts, params)
    stops = [SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[b.token_ids[j]])
             for b, j in zip(base, (5, 9, 13, 17))]
    stopped = await _generate(engine, CODE, stops)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in base]
    assert [o.token_ids for o in greedy_alone] == [o.token_ids for o in base[: len(CODE)]]
    first = len(CODE) + 4
    for i, p in enumerate(penalized, first):  # alone, drafts get accepted: each position sees the drafts before it
        before = _spec_counts(engine)[2]
        alone = await engine.generate(prompts[i], p)
        assert alone.token_ids == base[i].token_ids
        assert _spec_counts(engine)[2] > before, p
    for got, want in zip(alone.prompt_logprobs[1:], base[first + 3].prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys() and all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
    bad = SamplingParams(temperature=0.0, max_tokens=48, bad_words_token_ids=[base[0].token_ids[6:8]])
    outs = [await e.generate(prompts[0], bad) for e in (base_engine, engine)]
    assert outs[0].token_ids == outs[1].token_ids != base[0].token_ids  # a bad word seen across drafts
    before = _spec_counts(engine)[2]
    alone = await engine.generate(prompts[-1], params[-1])  # logprobs of accepted drafts: their positions' rows
    assert _spec_counts(engine)[2] > before and alone.token_ids == base[-1].token_ids
    for out in (drafted[-1], alone):
        for got, want in zip(out.logprobs, base[-1].logprobs, strict=True):  # other batches: float noise only
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 and got[t].rank == want[t].rank for t in got)
    expected = [_expected_acceptance(o.prompt_token_ids, o.token_ids, 48) for o in greedy_alone]
    assert counts == tuple(map(sum, zip(*expected)))
    assert counts[2] >= 20, "the bundled model's outputs repeat: drafts get accepted"
    assert sum(per_pos) == counts[2]
    assert per_pos[3] > 0
    for out, b, j in zip(stopped, base, (5, 9, 13, 17)):  # a stop token inside accepted drafts ends the request
        first = b.token_ids.index(b.token_ids[j])
        assert out.token_ids == b.token_ids[: first + 1] and out.finish_reason == "stop"


ITEMS = {"type": "array", "minItems": 3, "maxItems": 3,
         "items": {"type": "object", "properties": {"id": {"type": "integer"},  # written in this order: the
                                                    "name": {"type": "string", "maxLength": 4}},  # string ends the id
                   "required": ["name", "id"]}}


@pytest.mark.asyncio(loop_scope="module")
async def test_structured_requests_are_drafted_and_keep_their_tokens(bundled_engines) -> None:
    """Each draft position masked in the grammar's state after the drafts before it: JSON lists of objects (their
    keys repeat, so drafts get accepted) give the tokens of the engine without drafts, and parse."""
    base_engine, engine = bundled_engines
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured=StructuredOutputs(json=ITEMS)),
              SamplingParams(temperature=0.8, seed=2, max_tokens=160, structured=StructuredOutputs(json=ITEMS)),
              SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutputs(regex=r"(ab|cd)+x"))]
    prompts = CODE[:3]
    base = await _generate(base_engine, prompts, params)
    before = _spec_counts(engine)[2]
    drafted = await _generate(engine, prompts, params)
    assert _spec_counts(engine)[2] > before
    assert [o.token_ids for o in drafted] == [o.token_ids for o in base]
    for out in drafted[:2]:
        assert len(json.loads(out.text)) == 3
    assert drafted[2].text.endswith("x")


@pytest.mark.asyncio(loop_scope="module")
async def test_blocks_filled_by_accepted_drafts_enter_the_prefix_cache(bundled_engines) -> None:
    """A prompt that continues an earlier output hits as many blocks with drafts as without."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    hits, outputs = [], []
    for engine in bundled_engines:
        assert await engine.reset_prefix_cache()  # both start from an empty cache (the test above filled them)
        accepted = engine.stats().spec_decode_num_accepted_tokens
        first = await _generate(engine, CODE, [params] * len(CODE))
        before = engine.stats().prefix_cache_hits
        continued = [o.prompt_token_ids + o.token_ids for o in first]
        again = await _generate(engine, continued, [SamplingParams(temperature=0.0, max_tokens=8)] * len(CODE))
        hits.append(engine.stats().prefix_cache_hits - before)
        outputs.append([o.token_ids for o in first + again])
        if engine.config.speculative_config is not None:
            assert engine.stats().spec_decode_num_accepted_tokens > accepted
            value = engine.metrics_registry.get_sample_value(
                "asyncllm:spec_decode_num_accepted_tokens_total", {"model_name": engine._observer.stats.model_name, "engine": "0"})
            assert value == engine.stats().spec_decode_num_accepted_tokens
    assert outputs[0] == outputs[1]
    assert hits[0] == hits[1] >= 4 * 64 - 4 * 16


@pytest.mark.asyncio(loop_scope="module")
async def test_a_draft_row_with_no_allowed_token_fails_the_request_once_reached(bundled_engines) -> None:
    """After 42 42 (drafted from the prompt's 42s) bad words forbid both allowed tokens: the request fails as without
    drafts, never taking the token sampled from that row."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, allowed_token_ids=[42, 77],
                            bad_words_token_ids=[[42, 42, 42], [42, 42, 77]])
    for engine in bundled_engines:  # with drafts: 42 42 42 42 verified at the step after the first 42
        with pytest.raises(InvalidRequestError) as failure:
            await engine.generate({"prompt_token_ids": [42] * 24}, params)
        assert failure.value.field == "allowed_token_ids"


@pytest.mark.asyncio(loop_scope="module")
async def test_drafts_of_a_complete_grammar_whose_eos_is_forbidden_end_it_stop(bundled_engines) -> None:
    """Drafted 'c's past the grammar's end (allowed_token_ids without EOS leave that row empty): the request ends
    "stop" with the grammar's three, as without drafts, the refused token left out."""
    c = bundled_engines[0].tokenizer.convert_tokens_to_ids("c")
    params = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=[c],
                            structured=StructuredOutputs(regex="[a-c]{1,3}"))
    for engine in bundled_engines:
        out = await engine.generate({"prompt_token_ids": [c] * 24}, params)
        assert (out.text, out.token_ids, out.finish_reason) == ("ccc", [c] * 3, "stop")


@pytest.mark.asyncio(loop_scope="module")
async def test_a_drafted_step_that_admits_a_request_shows_it_running_before_its_output(bundled_engines) -> None:
    """Speculative decoding runs every step synchronously: a step that admits a request sends a fresh snapshot
    before it runs (engine/sync_step.py), so a long step never shows it waiting."""
    assert await snapshot_before_first_output(bundled_engines[1], [42] * 12) == (1, 0)
