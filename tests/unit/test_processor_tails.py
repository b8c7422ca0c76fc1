"""The per-step host reads of the logits processors stay short on long outputs: bad words read the output's last
tokens only, and a drafted request's positions (`DraftPosition`) read its token list in place, without a copy of
the prompt and outputs per position; the results stay those of the whole lists."""

from __future__ import annotations

import random

import pytest
import torch
from asyncllm.workers.input_types import RequestState
from asyncllm.workers.logits_processors import RowLogitsParams, build_logits_processors_metadata
from asyncllm.workers.spec_decode import DraftPosition, TokenPrefix

from asyncllm.sampling import SamplingParams

CPU = torch.device("cpu")


class CountingList(list):
    """A token list that counts the elements its slices copy."""

    copied = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        got = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.copied += len(got)
        return got


def _row(params: SamplingParams, tokens: list[int], num_prompt: int) -> RequestState:
    return RequestState("r", 0, tokens, num_prompt, len(tokens), params, RowLogitsParams.from_params(params, (0,)))


def _banned(rows: list) -> list[tuple[int, int]]:
    meta = build_logits_processors_metadata(rows, CPU)
    if meta is None or meta.banned is None:
        return []
    return sorted(zip(meta.banned[0].tolist(), meta.banned[1].tolist()))


def test_token_prefix_reads_as_the_list_up_to_its_end() -> None:
    tokens = list(range(10, 30))
    for end in (0, 1, 7, 20):
        view, ref = TokenPrefix(tokens, end), tokens[:end]
        assert len(view) == end and list(view) == ref
        for index in (slice(None), slice(-3, None), slice(2, 5), slice(5, 2), slice(-100, 100), slice(None, None, -1),
                      slice(1, None, 3), slice(end, None)):
            assert view[index] == ref[index], (end, index)
        for i in range(-end, end):
            assert view[i] == ref[i]
        for i in (end, -end - 1):
            with pytest.raises(IndexError):
                view[i]


def test_bad_words_match_the_output_only_and_read_its_tail() -> None:
    """A word's tokens before its last must all be outputs (vLLM's rule: the prompt never completes one); the
    builder copies only as many tokens as the longest word's before, however long the output."""
    params = SamplingParams(bad_words_token_ids=[[5, 6, 7], [6, 8], [9]])
    prompt = [1, 5, 6]
    assert _banned([_row(params, prompt, 3)]) == [(0, 9)]  # the prompt ends with 5 6: no output, not banned
    assert _banned([_row(params, prompt + [6], 3)]) == [(0, 8), (0, 9)]
    assert _banned([_row(params, prompt + [5, 6], 3)]) == [(0, 7), (0, 8), (0, 9)]
    assert _banned([_row(params, [1, 5] + [6], 2)]) == [(0, 8), (0, 9)]  # 5 in the prompt: only [6, 8] is whole
    rng = random.Random(0)
    for _ in range(20):  # against the rule on the whole output
        num_prompt, tokens = rng.randrange(4), [rng.choice([5, 6, 7]) for _ in range(rng.randrange(8))]
        outputs = tokens[num_prompt:]
        expected = [last for *before, last in params.bad_words_token_ids
                    if len(before) <= len(outputs) and outputs[len(outputs) - len(before):] == before]
        assert _banned([_row(params, tokens, min(num_prompt, len(tokens)))]) == [(0, t) for t in sorted(expected)]
    long = CountingList([1] * 100 + [rng.randrange(50) for _ in range(20000)] + [5, 6])
    CountingList.copied = 0
    assert _banned([_row(params, long, 100)]) == [(0, 7), (0, 8), (0, 9)]
    assert CountingList.copied <= 2  # the two last tokens, not the 20,000 outputs


def test_draft_positions_read_the_token_list_in_place_with_the_same_results() -> None:
    """Each position of a drafted request on a long output: the same banned tokens, min_tokens rows and pending
    drafts as a row holding a copy of its tokens up to there, from a few tokens read per position."""
    params = SamplingParams(bad_words_token_ids=[[20, 30], [20, 21, 31]], min_tokens=6, frequency_penalty=0.5)
    rng = random.Random(1)
    prompt = [rng.randrange(50) for _ in range(300)]
    drafts = [20, 21, 20]
    for outputs in ([], [20, 21], [rng.randrange(50) for _ in range(30000)]):
        k = len(drafts)
        state = _row(params, CountingList(prompt + outputs + drafts), len(prompt))
        state.logits_params.penalty_tables_ready = True  # type: ignore[union-attr]  # as after its first step
        CountingList.copied = 0
        positions = [DraftPosition.of(state, k, j) for j in range(k + 1)]
        meta = build_logits_processors_metadata(positions, CPU)
        assert CountingList.copied <= sum(range(k + 1)) + 2 * (k + 1)  # the pending drafts, each position's tail
        assert all(p.token_ids.tokens is state.token_ids for p in positions)
        copies = []
        for j in range(k + 1):
            copy = _row(params, prompt + outputs + drafts[:j], len(prompt))
            copy.logits_params.penalty_tables_ready = True  # type: ignore[union-attr]
            copies.append(copy)
        expected = build_logits_processors_metadata(copies, CPU)
        assert meta is not None and expected is not None
        assert _banned(positions) == _banned(copies)
        for got, want in ((meta.min_tokens, expected.min_tokens), (meta.banned, expected.banned)):
            assert (got is None) == (want is None)
            assert got is None or all(torch.equal(a, b) for a, b in zip(got, want))  # type: ignore[arg-type]
        assert meta.penalties is not None and meta.penalties.pending is not None
        assert meta.penalties.pending[1].tolist() == [d for j in range(k + 1) for d in drafts[:j]]
