"""Logits processors and logprobs against transformers' processors and the OpenAI formula.

Each test runs the worker's code path (`SamplingMetadata.from_params` ->
`apply_logits_processors` / `Sampler`) on the same random logits as the
reference and compares: exact where the operations are the same (masks,
additions), within 1e-6 where float rounding may differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from asyncllm.workers.logits_processors import (
    PenaltyTables,
    RowLogitsParams,
    apply_logits_processors,
    build_logits_processors_metadata,
)
from asyncllm.workers.sampler import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from asyncllm.sampling import SamplingParams

CPU = torch.device("cpu")
VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def processed(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
              outputs: list[list[int]], eos: tuple[int, ...] = ()) -> torch.Tensor:
    """The worker's logits after logit_bias, min_tokens and penalties."""
    meta = SamplingMetadata.from_params(params, [0] * len(params), CPU, prompts, outputs, eos)
    out = logits.clone()
    assert meta.logits_processors is not None
    apply_logits_processors(out, meta.logits_processors, PenaltyTables(CPU))
    return out


def openai_penalties(logits: torch.Tensor, outputs: list[int], presence: float, frequency: float) -> torch.Tensor:
    """mu[j] - c[j] * frequency - (c[j] > 0) * presence (the OpenAI API reference)."""
    counts = np.bincount(outputs, minlength=VOCAB)
    expected = logits.clone()
    for j in range(VOCAB):
        expected[j] -= counts[j] * frequency + float(counts[j] > 0) * presence
    return expected


# ------------------------------------------------------------------ penalties
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    logits = random_logits(3)
    prompts = [random_ids(12, 1), random_ids(5, 2), random_ids(1, 3)]
    outputs = [random_ids(7, 4), [], random_ids(20, 5)]
    got = processed(logits, [SamplingParams(repetition_penalty=penalty)] * 3, prompts, outputs)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i in range(3):
        input_ids = torch.tensor([prompts[i] + outputs[i]])
        torch.testing.assert_close(got[i], hf(input_ids, logits[i : i + 1].clone())[0], rtol=0, atol=1e-6)
    assert not torch.equal(got, logits)


def test_presence_and_frequency_penalties_match_the_openai_formula() -> None:
    logits = random_logits(3, seed=1)
    prompts = [random_ids(9, 6), random_ids(9, 7), random_ids(9, 8)]
    outputs = [random_ids(30, 8), random_ids(3, 9), random_ids(5, 10)]
    params = [SamplingParams(presence_penalty=0.8, frequency_penalty=0.3), SamplingParams(),
              SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0)]
    got = processed(logits, params, prompts, outputs)
    for i, p in enumerate(params):  # prompt tokens do not count for these two
        expected = openai_penalties(logits[i], outputs[i], p.presence_penalty, p.frequency_penalty)
        torch.testing.assert_close(got[i], expected, rtol=0, atol=1e-5)
    assert torch.equal(got[1], logits[1])  # a row without penalties in a penalized batch


def test_all_penalties_together_compose_in_vllm_order() -> None:
    logits = random_logits(1, seed=2)
    prompt, output = random_ids(10, 10), random_ids(15, 11)
    params = SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.25)
    got = processed(logits, [params], [prompt], [output])
    repeated = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([prompt + output]), logits.clone())[0]
    torch.testing.assert_close(got[0], openai_penalties(repeated, output, 0.5, 0.25), rtol=0, atol=1e-5)


def test_penalty_counts_are_kept_incrementally_across_steps() -> None:
    """The sampler's tables, initialised once and updated with each sampled token, equal a recount."""
    sampler = Sampler(0, CPU)
    prompt = random_ids(6, 12)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.2, repetition_penalty=1.1)
    row = _Row(row=5, token_ids=list(prompt), num_prompt_tokens=len(prompt),
               logits_params=RowLogitsParams.from_params(params, ()))
    for step in range(12):
        logits = random_logits(1, seed=100 + step)
        outputs = row.token_ids[len(prompt):]
        repeated = RepetitionPenaltyLogitsProcessor(1.1)(torch.tensor([row.token_ids]), logits.clone())[0]
        expected = openai_penalties(repeated, outputs, 0.2, 0.7)
        processors = build_logits_processors_metadata([row], CPU)
        assert processors is not None and processors.penalties is not None
        assert len(processors.penalties.fresh) == (1 if step == 0 else 0)  # later steps only record
        meta = SamplingMetadata.from_arrays(np.zeros(1, np.float32), np.zeros(1, np.int64), np.ones(1, np.float32),
                                            np.zeros(1, np.float32), [None], [0], CPU, processors)
        token = sampler(logits, meta).sampled_token_ids.item()
        assert token == int(expected.argmax())
        row.token_ids.append(token)
    counts = sampler.penalty_tables.output_counts
    assert counts is not None and counts.shape[0] >= 6
    assert counts[5].tolist() == np.bincount(row.token_ids[len(prompt):], minlength=VOCAB).tolist()
    assert len(set(row.token_ids[len(prompt):])) > 3  # the penalties moved the argmax around


@dataclass
class _Row:
    row: int
    token_ids: list[int]
    num_prompt_tokens: int
    logits_params: RowLogitsParams | None
    params: SamplingParams | None = None


def test_a_drafted_request_s_positions_see_the_drafts_before_them_as_outputs() -> None:
    """Speculative decoding: at each draft position (and the last) the penalties, min_tokens and bad words are those
    of a request whose outputs end with the drafts before it; the sampler counts none of a drafted request's
    tokens, the verified ones are counted after (`record_tokens`)."""
    from asyncllm.workers.spec_decode import DraftPosition

    prompt, outputs, drafts = [1, 2, 3, 4, 5, 6], [7, 8, 9], [20, 21, 20]  # drafts new to prompt and outputs
    params = SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.2, repetition_penalty=1.3,
                            min_tokens=5, bad_words_token_ids=[[20, 30]])

    def row(tokens: list[int]) -> _Row:
        return _Row(5, tokens, len(prompt), RowLogitsParams.from_params(params, (0,)), params)

    state, k = row(prompt + outputs + drafts), len(drafts)
    sampler = Sampler(0, CPU)
    sampler.penalty_tables.apply(random_logits(1), build_logits_processors_metadata(  # type: ignore[union-attr]
        [row(prompt + outputs)], CPU).penalties)  # the table as earlier steps left it: prompt and 3 outputs
    state.logits_params.penalty_tables_ready = True  # type: ignore[union-attr]
    views = [DraftPosition.of(state, k, k)] + [DraftPosition.of(state, k, j) for j in range(k)]
    logits = random_logits(1 + k, seed=3)
    meta = build_logits_processors_metadata(views, CPU)
    assert meta is not None and meta.penalties is not None and not meta.penalties.fresh
    got = logits.clone()
    apply_logits_processors(got, meta, sampler.penalty_tables)
    for i, before in enumerate([k, 0, 1, 2]):
        alone = logits[i : i + 1].clone()
        apply_logits_processors(alone, build_logits_processors_metadata([row(prompt + outputs + drafts[:before])],
                                                                        CPU), PenaltyTables(CPU))
        torch.testing.assert_close(got[i], alone[0], rtol=0, atol=1e-6)
    assert got[2, 30] == float("-inf") and got[1, 30] > float("-inf")  # after draft 20: the bad word's end
    assert got[1, 0] == float("-inf") and got[0, 0] > float("-inf")  # EOS masked until the fifth output
    sampler.penalty_tables.record(meta.penalties, torch.tensor([40, 41, 42, 43]))
    counts = sampler.penalty_tables.output_counts
    assert counts is not None and counts[5].tolist() == np.bincount(outputs, minlength=VOCAB).tolist()
    sampler.penalty_tables.record_tokens(5, [20, 21, 42])  # two drafts accepted, then the sampled token
    assert counts[5].tolist() == np.bincount(outputs + [20, 21, 42], minlength=VOCAB).tolist()


# ------------------------------------------------------------------ logit_bias, min_tokens, min_p, top-k/top-p
def test_logit_bias_matches_sequence_bias() -> None:
    logits = random_logits(2, seed=3)
    bias = {3: 2.5, 17: -100.0, 49: 0.125}
    got = processed(logits, [SamplingParams(logit_bias=bias), SamplingParams()], [[1], [1]], [[], []])
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    assert torch.equal(got[0], hf(torch.tensor([[1]]), logits[:1].clone())[0])
    assert torch.equal(got[1], logits[1])


def test_min_tokens_matches_min_new_tokens_and_masks_stop_token_ids() -> None:
    logits = random_logits(3, seed=4)
    eos = (7, 9)
    params = [SamplingParams(min_tokens=4), SamplingParams(min_tokens=4, stop_token_ids=[2]),
              SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=[2])]
    prompt = random_ids(5, 13)
    got = processed(logits, params, [prompt] * 3, [[1, 1, 1]] * 3, eos)  # 3 outputs < 4: masked
    hf = MinNewTokensLengthLogitsProcessor(len(prompt), 4, list(eos))
    assert torch.equal(got[0], hf(torch.tensor([prompt + [1, 1, 1]]), logits[:1].clone())[0])
    inf = float("-inf")
    assert got[1, [2, 7, 9]].tolist() == [inf] * 3
    assert got[2, [2, 7, 9]].tolist() == [inf] * 3  # ignore_eos too: vLLM masks its all_stop_token_ids
    reached = SamplingMetadata.from_params(params, [0] * 3, CPU, [prompt] * 3, [[1] * 4] * 3, eos)
    assert reached.logits_processors is None  # nothing left to do once min_tokens outputs exist


def test_min_p_matches_transformers() -> None:
    logits = random_logits(4, seed=5)
    min_p = torch.tensor([0.05, 0.2, 0.5, 0.9])
    got = apply_min_p(logits, min_p)
    for i in range(4):
        expected = MinPLogitsWarper(float(min_p[i]))(torch.tensor([[0]]), logits[i : i + 1].clone())[0]
        assert torch.equal(got[i], expected)


def test_top_k_and_top_p_match_transformers() -> None:
    logits = random_logits(2, seed=6)
    got_k = apply_top_k_top_p(logits, torch.tensor([5, 12]), None)
    got_p = apply_top_k_top_p(logits, None, torch.tensor([0.3, 0.9]))
    for i, (k, p) in enumerate([(5, 0.3), (12, 0.9)]):
        ids = torch.tensor([[0]])
        assert torch.equal(got_k[i], TopKLogitsWarper(k)(ids, logits[i : i + 1].clone())[0])
        assert torch.equal(got_p[i].isinf(), TopPLogitsWarper(p)(ids, logits[i : i + 1].clone())[0].isinf())


def test_greedy_rows_get_processors_too() -> None:
    logits = random_logits(2, seed=7)
    target = int(logits[0].argmin())
    params = [SamplingParams(temperature=0.0, logit_bias={target: 100.0}), SamplingParams(temperature=0.0)]
    tokens = Sampler(0, CPU)(logits.clone(), SamplingMetadata.from_params(params, [0, 0], CPU)).sampled_token_ids
    assert tokens.tolist() == [target, int(logits[1].argmax())]


# ------------------------------------------------------------------ logprobs
def test_logprobs_are_raw_log_softmax_with_ranks_and_top_n() -> None:
    logits = random_logits(3, seed=8)
    params = [SamplingParams(temperature=0.8, logprobs=4, seed=1, repetition_penalty=1.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0, logit_bias={0: 100.0})]
    meta = SamplingMetadata.from_params(params, [5, 5, 5], CPU, [[0, 1]] * 3, [[2]] * 3)
    out = Sampler(0, CPU)(logits.clone(), meta)
    reference = logits.log_softmax(-1)  # before bias, penalties and temperature
    assert out.logprobs is not None and len(out.logprobs) == 2
    for arrays, row in zip(out.logprobs, (0, 2)):
        ids = np.frombuffer(arrays.token_ids, "<i4").reshape(-1, arrays.width)
        values = np.frombuffer(arrays.logprobs, "<f4").reshape(-1, arrays.width)
        rank = int(np.frombuffer(arrays.ranks, "<i4")[0])
        token = int(out.sampled_token_ids[row])
        assert ids[0, 0] == token and values[0, 0] == pytest.approx(float(reference[row, token]), abs=1e-6)
        assert rank == int((reference[row] >= reference[row, token]).sum())
        top = reference[row].topk(arrays.width - 1)
        assert ids[0, 1:].tolist() == top.indices.tolist()
        np.testing.assert_allclose(values[0, 1:], top.values.numpy(), atol=1e-6)
    assert out.logprobs[0].width == 5 and out.logprobs[1].width == 1
    assert int(out.sampled_token_ids[2]) == 0


@pytest.mark.parametrize("modes", [("raw_logits", None, None), ("processed_logprobs", None, None),
                                   ("processed_logits", None, None), ("raw_logits", "processed_logprobs", None),
                                   ("processed_logits", None, "raw_logprobs")])
def test_logprobs_mode_picks_the_logits_before_or_after_processing(modes: tuple) -> None:
    """vLLM's ``logprobs_mode``: raw = the model's logits; processed = after the processors (a penalty, a bias) and,
    for a sampled row, temperature and top-k (the distribution its token was drawn from: masked tokens -inf). A
    request's own ``logprobs_mode`` (`modes` after the engine's) applies to its row alone."""
    engine_mode, *row_modes = modes
    logits = random_logits(2, seed=9)
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=5, seed=2, repetition_penalty=1.5,
                             logprobs_mode=row_modes[0]),
              SamplingParams(temperature=0.0, logprobs=2, logit_bias={7: 4.0}, logprobs_mode=row_modes[1])]
    meta = SamplingMetadata.from_params(params, [5, 5], CPU, [[0, 1]] * 2, [[2]] * 2)
    out = Sampler(0, CPU, engine_mode)(logits.clone(), meta)
    processed = logits.clone()
    processed[0] = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[0, 1, 2]]), logits[:1].clone())[0] / 0.5
    processed[0] = processed[0].masked_fill(processed[0] < processed[0].topk(3).values[-1], float("-inf"))
    processed[1, 7] += 4.0
    assert out.logprobs is not None
    for row, arrays in enumerate(out.logprobs):
        mode = row_modes[row] or engine_mode
        expected = processed if mode.startswith("processed") else logits
        expected = expected if mode.endswith("logits") else expected.log_softmax(-1)
        ids = np.frombuffer(arrays.token_ids, "<i4").reshape(-1, arrays.width)[0]
        values = np.frombuffer(arrays.logprobs, "<f4").reshape(-1, arrays.width)[0]
        np.testing.assert_allclose(values, expected[row, ids.tolist()].numpy(), atol=1e-5)
        assert ids[0] == int(out.sampled_token_ids[row])
    if (row_modes[0] or engine_mode).startswith("processed"):
        assert np.isinf(np.frombuffer(out.logprobs[0].logprobs, "<f4")[-2:]).all()  # top 5 of 3 kept: 2 masked


def test_rows_with_no_allowed_token_left_are_exhausted() -> None:
    params = [SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[[3, 3], [3, 4]]),  # after a 3: none
              SamplingParams(allowed_token_ids=[3, 4], bad_words_token_ids=[[3, 3]]),
              SamplingParams(allowed_token_ids=[7], min_tokens=5)]  # EOS 7, masked until 5 outputs
    meta = SamplingMetadata.from_params(params, [0] * 3, CPU, [[1]] * 3, [[3]] * 3, (7,))
    assert meta.logits_processors is not None and meta.logits_processors.exhausted == (0, 2)
    meta = SamplingMetadata.from_params(params, [0] * 3, CPU, [[1]] * 3, [[4]] * 3, (7,))
    assert meta.logits_processors is not None and meta.logits_processors.exhausted == (2,)


def test_rows_after_drafts_fail_their_request_once_verified_tokens_reach_them() -> None:
    """A row right after the committed tokens fails its request at once; a row after j drafts only if the drafts
    before it are accepted (the (j + 1)th verified token would be sampled there, from no allowed token)."""
    from asyncllm.workers.spec_decode import exhausted_requests
    from asyncllm.workers.logits_processors import EXHAUSTED_ERROR
    from asyncllm.workers.spec_decode import DraftedRequest, exhausted_after_drafts

    req_ids = ["a", "b", "c"]  # b samples nothing; c drafts two tokens: rows 1 (after both), 2 and 3 (at its drafts)
    drafted = [DraftedRequest(sample=1, first_row=2, drafts=[5, 6])]
    assert exhausted_requests(req_ids, [0, 2], drafted, (0, 1, 3)) == ({"a": EXHAUSTED_ERROR}, {1: 1})
    assert exhausted_requests(req_ids, [0, 2], drafted, (1,)) == ({}, {1: 2})
    assert exhausted_requests(req_ids, [0, 2], drafted, (2,)) == ({"c": EXHAUSTED_ERROR}, {})
    assert exhausted_after_drafts({1: [5, 9]}, {1: 1}) == [1]  # draft 5 accepted: the next token is row 3's
    assert exhausted_after_drafts({1: [8]}, {1: 1}) == []  # draft 5 rejected: row 3 samples nothing
    assert exhausted_after_drafts({1: [5, 9]}, {1: 2}) == []
    assert exhausted_after_drafts({1: [5, 6, 9]}, {1: 2}) == [1]  # every draft accepted: the bonus row's token
