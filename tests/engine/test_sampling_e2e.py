"""Sampling parameters and outputs on a real engine (core + worker) with a tiny float32 model.

Logprobs and prompt logprobs are checked against transformers' logits
(log_softmax, within 1e-5); penalties and logit_bias against transformers'
processors applied to transformers' logits in a greedy loop. The engine runs
with max_num_batched_tokens=64 so long prompts are prefilled in chunks.
"""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
import pytest_asyncio
import torch
from hf_reference import hf_greedy, hf_logits
from transformers import AutoTokenizer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from asyncllm import AsyncEngine, InvalidRequestError, RequestOutputKind, SamplingParams, StructuredOutputs
from asyncllm.tokenizer import bad_words_token_ids
from engine_helpers import wait_idle as _wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "def parse(text):\n    return"
LONG_PROMPT = "class Stack:\n    def push(self, item):\n        self.items.append(item)\n" * 6
EOS = 1
USER = 3  # "<|user|>", a special token of the tiny tokenizer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=512, max_num_batched_tokens=64,
                         max_num_seqs=16, max_logprobs=40)
    async with engine:
        yield engine


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: str):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _check_logprob_entry(entry: dict, token_id: int, reference: torch.Tensor, num_top: int, tokenizer) -> None:
    """`entry` is {token: Logprob} for `token_id` then the top `num_top` under `reference` (log_softmax)."""
    first = next(iter(entry))
    assert first == token_id
    own = entry[token_id]
    assert own.logprob == pytest.approx(float(reference[token_id]), abs=1e-5)
    assert own.rank == int((reference >= reference[token_id]).sum())
    assert own.decoded_token == tokenizer.decode([token_id], skip_special_tokens=False)
    top = reference.topk(num_top)
    for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert entry[tid].logprob == pytest.approx(value, abs=1e-5)
        if tid != token_id:
            assert entry[tid].rank == rank
    assert set(entry) == {token_id, *top.indices.tolist()}


# ------------------------------------------------------------------ logprobs
async def test_logprobs_match_transformers(engine: AsyncEngine, tokenizer) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    out = await engine.generate(PROMPT, params)
    prompt_ids = out.prompt_token_ids
    logprobs = hf_logits(engine.config.model, prompt_ids + out.token_ids).log_softmax(-1)
    assert out.logprobs is not None and len(out.logprobs) == 8 and out.outputs[0].logprobs is out.logprobs
    for i, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        _check_logprob_entry(entry, token_id, logprobs[len(prompt_ids) - 1 + i], 5, tokenizer)
        assert entry[token_id].rank == 1  # greedy
    streamed = [d async for d in engine.stream(PROMPT, params)]
    assert [e for d in streamed for e in d.logprobs] == out.logprobs
    total = sum(float(logprobs[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(out.token_ids))
    assert out.outputs[0].cumulative_logprob == pytest.approx(total, abs=1e-4) == streamed[-1].cumulative_logprob
    assert out.outputs[0].finished()
    wide = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=40))
    _check_logprob_entry(wide.logprobs[0], wide.token_ids[0], logprobs[len(prompt_ids) - 1], 40, tokenizer)
    for field in ("logprobs", "prompt_logprobs"):  # max_logprobs=40: vLLM's default is 20
        with pytest.raises(InvalidRequestError, match="at most 40 .the engine's max_logprobs") as raised:
            await engine.generate(PROMPT, SamplingParams(max_tokens=2, **{field: 41}))
        assert raised.value.field == field


async def test_prompt_logprobs_match_transformers_across_chunks(engine: AsyncEngine, tokenizer) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    first = await engine.generate(LONG_PROMPT, params)
    prompt_ids = first.prompt_token_ids
    assert len(prompt_ids) > 2 * 64  # at least three prefill chunks
    reference = hf_logits(engine.config.model, prompt_ids).log_softmax(-1)
    entries = first.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt_ids) and entries[0] is None
    for j in range(1, len(prompt_ids)):
        _check_logprob_entry(entries[j], prompt_ids[j], reference[j - 1], 3, tokenizer)
    again = await engine.generate(LONG_PROMPT, params)  # the blocks are cached now, yet not read
    assert again.prompt_logprobs == entries and again.token_ids == first.token_ids
    stream = [d async for d in engine.stream(LONG_PROMPT, params)]
    assert stream[0].prompt_logprobs == entries and all(d.prompt_logprobs is None for d in stream[1:])



async def test_byte_tokens_name_their_character_on_its_last_byte(engine: AsyncEngine, tokenizer) -> None:
    """vLLM V1's decoded_token for a character of byte tokens: "" until its last byte, which names it; in the
    prompt across the first prefill chunk's end (64 tokens), and in a sample streamed a token a delta ("€€")."""
    euro = tokenizer.encode("\u20ac", add_special_tokens=False)
    assert [tokenizer.decode([t]) for t in euro] == ["\ufffd"] * 3  # three byte tokens alone
    prompt = tokenizer(LONG_PROMPT).input_ids[:62] + euro
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, prompt_logprobs=0,
                            structured=StructuredOutputs(regex="\u20ac\u20ac"))
    deltas = [d async for d in engine.stream(prompt, params)]
    assert [t for d in deltas for t in d.token_ids] == euro * 2
    names = [entry[t].decoded_token for d in deltas for t, entry in zip(d.token_ids, d.logprobs)]
    assert names == ["", "", "\u20ac"] * 2
    assert [entry[t].decoded_token for t, entry in zip(prompt[-4:], deltas[0].prompt_logprobs[-4:])] == [
        tokenizer.decode(prompt[-4:-3]), "", "", "\u20ac"]


# ------------------------------------------------------------------ penalties, logit_bias, min_tokens
async def test_penalties_match_transformers_processors(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.3, logit_bias={10: 1.5})
    out = await engine.generate(PROMPT, params)
    tokens = list(out.prompt_token_ids)
    for _ in range(12):
        logits = hf_logits(engine.config.model, tokens)[-1:].clone()
        logits[0, 10] += 1.5
        logits = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([tokens]), logits)[0]
        counts = torch.bincount(torch.tensor(tokens[len(out.prompt_token_ids):], dtype=torch.int64), minlength=logits.shape[0])
        tokens.append(int((logits - 0.4 * counts - 0.3 * (counts > 0)).argmax()))
    assert out.token_ids == tokens[len(out.prompt_token_ids):]
    plain = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert plain.token_ids != out.token_ids


async def test_logit_bias_forces_and_bans_and_is_checked_against_the_vocab(engine: AsyncEngine) -> None:
    forced = await engine.generate(PROMPT, SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True, logit_bias={42: 100}))
    assert forced.token_ids == [42] * 5
    plain = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    banned = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, logit_bias={plain.token_ids[0]: -100}))
    logits = hf_logits(engine.config.model, plain.prompt_token_ids)[-1]
    logits[plain.token_ids[0]] -= 100
    assert banned.token_ids == [int(logits.argmax())]
    with pytest.raises(InvalidRequestError) as info:
        await engine.generate(PROMPT, SamplingParams(logit_bias={512: 1.0}))
    assert info.value.field == "logit_bias"


async def test_allowed_token_ids_and_bad_words_match_transformers(engine: AsyncEngine, tokenizer) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    plain = await engine.generate(PROMPT, SamplingParams(**greedy))
    path, prompt_ids = engine.config.model, plain.prompt_token_ids
    allowed = sorted(set(plain.token_ids[1::3]) | {42, 77})
    restricted = await engine.generate(PROMPT, SamplingParams(**greedy, allowed_token_ids=allowed))
    assert restricted.token_ids == hf_greedy(path, prompt_ids, 12, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert set(restricted.token_ids) <= set(allowed) and restricted.token_ids != plain.token_ids
    pieces = [plain.token_ids[i:i + size] for size in (2, 1) for i in range(1, 10)]
    pieces = [p for p in pieces if tokenizer.decode(p).strip() and tokenizer.encode(tokenizer.decode(p), add_special_tokens=False) == p
              and p in bad_words_token_ids(tokenizer, [tokenizer.decode(p)])]  # vLLM's rule may leave " w" out
    assert (len(pieces[0]), len(pieces[-1])) == (2, 1)
    words = [tokenizer.decode(pieces[0]), tokenizer.decode(pieces[-1])]  # a two-token word and a one-token word
    banned = await engine.generate(PROMPT, SamplingParams(**greedy, bad_words=words))
    ids = bad_words_token_ids(tokenizer, words)
    assert pieces[0] in ids and pieces[-1] in ids
    assert banned.token_ids == hf_greedy(path, prompt_ids, 12, bad_words_ids=ids) != plain.token_ids
    for errors, field in [({"allowed_token_ids": [512]}, "allowed_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
                          ({"bad_words": [" "]}, "bad_words"),
                          ({"allowed_token_ids": pieces[-1], "bad_words": [words[1]]}, "allowed_token_ids"),  # all banned
                          ({"allowed_token_ids": [EOS], "min_tokens": 2}, "allowed_token_ids"),
                          ({**greedy, "allowed_token_ids": [42, 77], "max_tokens": 4,  # all banned after one token
                            "bad_words_token_ids": [[a, b] for a in (42, 77) for b in (42, 77)]}, "allowed_token_ids")]:
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate(PROMPT, SamplingParams(**errors))
        assert info.value.field == field
    assert (await engine.generate(PROMPT, SamplingParams(**greedy))).token_ids == plain.token_ids  # serving on


async def test_min_tokens_masks_eos_and_stop_token_ids(engine: AsyncEngine, tokenizer) -> None:
    out = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, logit_bias={EOS: 100}))
    assert out.token_ids[:5] != [EOS] * 5 and EOS not in out.token_ids[:5]
    assert out.token_ids[5:] == [EOS] and out.finish_reason == "stop"
    out = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3,
                                                       stop_token_ids=[42], logit_bias={42: 100}))
    assert len(out.token_ids) == 4 and 42 not in out.token_ids[:3]
    assert (out.token_ids[3], out.finish_reason, out.outputs[0].stop_reason) == (42, "stop", 42)
    # as vLLM: the stop token's text is left out, unless include_stop_str_in_output
    assert tokenizer.decode([42]) and out.text == tokenizer.decode(out.token_ids[:3])
    kept = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3,
                                                        stop_token_ids=[42], logit_bias={42: 100},
                                                        include_stop_str_in_output=True))
    assert kept.token_ids == out.token_ids and kept.text == tokenizer.decode(out.token_ids)


async def test_skip_special_tokens(engine: AsyncEngine) -> None:
    params = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={USER: 100})
    assert (await engine.generate(PROMPT, SamplingParams(**params))).text == ""
    kept = await engine.generate(PROMPT, SamplingParams(**params, skip_special_tokens=False))
    assert kept.text == "<|user|>" * 3


# ------------------------------------------------------------------ n > 1
async def test_detokenize_false_gives_the_same_ids_and_logprobs_without_text(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    text, ids_only = await asyncio.gather(
        engine.generate(PROMPT, params), engine.generate(PROMPT, msgspec.structs.replace(params, detokenize=False)))
    assert ids_only.token_ids == text.token_ids and text.outputs[0].text and ids_only.outputs[0].text == ""
    for got, want in zip(ids_only.outputs[0].logprobs + ids_only.prompt_logprobs[1:],
                         text.outputs[0].logprobs + text.prompt_logprobs[1:]):
        assert list(got) == list(want)  # the same tokens; values within float32 rounding (batched together)
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-5)
        assert all(lp.decoded_token is None for lp in got.values())
        assert all(lp.decoded_token is not None for lp in want.values())
    streamed = [delta async for delta in engine.stream(PROMPT, SamplingParams(max_tokens=5, detokenize=False))]
    assert all(d.text == "" for d in streamed) and sum(len(d.token_ids) for d in streamed) == 5
    with pytest.raises(InvalidRequestError, match="detokenize=True") as info:
        await engine.generate(PROMPT, SamplingParams(stop=["\n"], detokenize=False))
    assert info.value.field == "stop"


async def test_n_stream_carries_indexes_and_generate_returns_every_sample(engine: AsyncEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=1)
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    sums = {0: 0.0, 1: 0.0, 2: 0.0}
    finished = []
    async for delta in engine.stream(PROMPT, params):
        streamed[delta.index] += delta.token_ids
        assert len(delta.logprobs) == len(delta.token_ids)
        sums[delta.index] += sum(e[t].logprob for t, e in zip(delta.token_ids, delta.logprobs))
        assert delta.cumulative_logprob == pytest.approx(sums[delta.index])  # vLLM's running total
        if delta.finished:
            finished.append(delta.index)
    assert sorted(finished) == [0, 1, 2]
    out = await engine.generate(PROMPT, params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert {o.index: o.token_ids for o in out.outputs} == streamed
    assert len({tuple(t) for t in streamed.values()}) == 3
    assert {o.index: o.cumulative_logprob for o in out.outputs} == pytest.approx(sums)  # each sample its own
    cumulative = [d async for d in engine.stream(PROMPT, msgspec.structs.replace(params, output_kind="cumulative"))]
    assert {d.index: d.cumulative_logprob for d in cumulative if d.finished} == pytest.approx(sums)
    alone = await engine.generate(PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    assert alone.token_ids == streamed[0]  # sample 0 keeps the request's seed
    assert alone.outputs[0].cumulative_logprob is None  # no logprobs asked
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time and m.num_generated_tokens == 24


async def test_seeded_samples_are_the_same_alone_and_in_a_busy_batch(engine: AsyncEngine) -> None:
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)
    alone = await engine.generate(PROMPT, params)
    noise = [engine.generate(f"x{i} = {i} *", SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True,
                                                             presence_penalty=0.5, logprobs=2)) for i in range(5)]
    busy, *_ = await asyncio.gather(engine.generate(PROMPT, params), *noise)
    assert [o.token_ids for o in busy.outputs] == [o.token_ids for o in alone.outputs]


async def test_leaving_an_n_stream_aborts_every_sample(engine: AsyncEngine) -> None:
    stream = engine.stream(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=400, ignore_eos=True))
    seen = set()
    async for delta in stream:
        seen.add(delta.index)
        if len(seen) == 3:
            break
    assert engine.stats().num_used_blocks > 0
    await stream.aclose()
    await _wait_idle(engine)


# ------------------------------------------------------------------ output kinds, stop strings, request ids
async def test_output_kinds(engine: AsyncEngine) -> None:
    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = await engine.generate(PROMPT, SamplingParams(**base))
    cumulative = [d async for d in engine.stream(PROMPT, SamplingParams(**base, output_kind="cumulative"))]
    assert len(cumulative) > 1
    for before, after in zip(cumulative, cumulative[1:]):
        assert after.text.startswith(before.text) and after.token_ids[: len(before.token_ids)] == before.token_ids
    assert (cumulative[-1].text, cumulative[-1].token_ids) == (expected.text, expected.token_ids)
    final = [d async for d in engine.stream(PROMPT, SamplingParams(**base, n=2, output_kind=RequestOutputKind.FINAL_ONLY))]
    assert sorted(d.index for d in final) == [0, 1] and all(d.finished for d in final)
    assert all((d.text, d.token_ids) == (expected.text, expected.token_ids) for d in final)
    deltas = [d async for d in engine.stream(PROMPT, SamplingParams(**base))]
    assert "".join(d.text for d in deltas) == expected.text and len(deltas) > 1


async def test_stop_string_split_across_tokens_never_leaks_into_the_stream(engine: AsyncEngine, tokenizer) -> None:
    base = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = await engine.generate(PROMPT, SamplingParams(**base))
    stop = None
    for k in range(2, len(full.token_ids)):  # a 3-character stop string with a token boundary inside
        prefix = tokenizer.decode(full.token_ids[:k])
        o = len(prefix)
        if full.text.startswith(prefix) and o + 2 <= len(full.text):
            candidate = full.text[o - 1 : o + 2]
            if full.text.find(candidate) == o - 1:
                stop = candidate
                break
    assert stop is not None
    for include in (False, True):
        text = ""
        async for delta in engine.stream(PROMPT, SamplingParams(**base, stop=[stop], include_stop_str_in_output=include)):
            text += delta.text
            assert include or stop not in text
        end = full.text.index(stop) + (len(stop) if include else 0)
        assert text == full.text[:end] and delta.finish_reason == "stop" and delta.stop_reason == stop


async def test_a_priority_under_fcfs_is_a_typed_error_and_the_engine_serves_on(engine: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await engine.generate(PROMPT, SamplingParams(max_tokens=2), priority=3)
    assert info.value.field == "priority"
    for priority in (2**63, -2**63 - 1):  # past the wire's int64: refused on the host, not a dead processor thread
        with pytest.raises(InvalidRequestError, match="int64") as info:
            await engine.generate(PROMPT, SamplingParams(max_tokens=2), priority=priority)
        assert info.value.field == "priority"
    with pytest.raises(InvalidRequestError):  # a lone surrogate (no UTF-8): refused, the processor thread lives on
        await engine.generate(PROMPT, SamplingParams(max_tokens=2, n=2), request_id="\ud800")
    assert len((await engine.generate(PROMPT, SamplingParams(max_tokens=2), priority=0)).token_ids) == 2


async def test_caller_request_ids_are_unique_among_in_flight_requests(engine: AsyncEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    async with engine.stream(PROMPT, long, request_id="dup") as first:
        await first.__anext__()
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate(PROMPT, SamplingParams(max_tokens=2), request_id="dup")
        assert info.value.field == "request_id"
    async with engine.stream(PROMPT, SamplingParams(n=2, temperature=0.0, max_tokens=400, ignore_eos=True),
                             request_id="pair") as pair:
        await pair.__anext__()
        with pytest.raises(InvalidRequestError, match="request_id"):
            await engine.generate(PROMPT, SamplingParams(max_tokens=2), request_id="pair")
        # the samples' core ids carry the host's submission number: another request's id never collides with them
        assert (await engine.generate(PROMPT, SamplingParams(max_tokens=2), request_id="pair-1")).request_id == "pair-1"
    out = await engine.generate(PROMPT, SamplingParams(max_tokens=2), request_id="dup")  # free again
    assert out.request_id == "dup"
    await _wait_idle(engine)


async def test_stream_interval_batches_a_streams_tokens(tiny_llama: str) -> None:
    """stream_interval=4: the first token comes alone, then deltas of 4 tokens or more (the consumer may merge
    more), the last ones at once; the tokens are the same as without it."""
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    async with AsyncEngine(tiny_llama, stream_interval=4, disable_log_stats=True) as paced:
        deltas = [delta async for delta in paced.stream(PROMPT, params)]
    sizes = [len(delta.token_ids) for delta in deltas]
    assert sum(sizes) == 14 and sizes[0] in (1, *range(5, 15)) and all(size >= 4 for size in sizes[1:-1]), sizes
    assert len(sizes) <= 5 and deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == hf_greedy(tiny_llama, list(AutoTokenizer.from_pretrained(
        tiny_llama)(PROMPT).input_ids), 14, eos_token_id=None)


async def test_an_engine_closed_mid_stream_delivers_the_tokens_stream_interval_held() -> None:
    """The abort that `aclose()` ends a paced stream with carries the tokens the pacer held (they were dropped, while
    the cumulative logprob counted them): the stream's tokens are its logprob rows, summing to that logprob."""
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, logprobs=0)
    paced = AsyncEngine(None, stream_interval=10_000, disable_log_stats=True)
    stream = paced.stream(PROMPT, params)
    deltas = [await stream.__anext__()]  # the first token comes alone; the next ones are held
    await asyncio.sleep(0.2)
    await paced.aclose()
    deltas += [delta async for delta in stream]
    tokens = [t for d in deltas for t in d.token_ids]
    rows = [row for d in deltas for row in d.logprobs or ()]
    assert deltas[-1].finish_reason == "abort" and 1 < len(tokens) < 400
    assert len(rows) == len(tokens)
    assert math.isclose(sum(row[t].logprob for row, t in zip(rows, tokens)), deltas[-1].cumulative_logprob,
                        rel_tol=1e-5)
