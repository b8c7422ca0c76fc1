"""Verifying a step's drafts (speculative decoding; docs/speculative.md).

A drafted request schedules its last token and its k drafts. Its logits rows
are the k + 1 positions: the usual sampling row (the last position) keeps
its place among the step's sampling rows, and the k positions before it are
extra rows appended after them (`DraftedRequest`). Every row is sampled by
the ordinary sampler, as if it were a decode step at that position (seeded
requests draw the noise of that position), and the drafts are accepted
while each equals the token sampled at its position; the first position
where they differ gives its sampled token instead, and if every draft is
accepted the last row's token follows them.

For greedy requests this is the argmax at each position, so the output is
token for token the output without drafts. For random sampling it is exact
rejection sampling for a draft that proposes one token with certainty (the
n-gram proposer): a draft ``d`` is accepted with probability ``p(d)``, and
a rejected one is replaced by a token drawn from ``p`` without ``d``, so
every token is drawn from the target distribution; with a seed, a request's
tokens are the ones it samples without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from asyncllm.workers.logits_processors import EXHAUSTED_ERROR

__all__ = [
    "DraftPosition", "DraftedRequest", "TokenPrefix", "exhausted_after_drafts", "exhausted_requests", "plan_drafted",
    "verify_drafts",
]


@dataclass
class DraftedRequest:
    """Where one drafted request's rows are among the step's logits rows."""

    sample: int
    """Its index among the sampling requests (its last position's row)."""
    first_row: int
    """The logits row of its first draft position; the k rows from here are its draft positions."""
    drafts: list[int]


class TokenPrefix(Sequence[int]):
    """The first ``end`` tokens of a list, read in place: a drafted request's tokens up to one position without a
    copy of them (the processors read the length and the last few tokens each step; a slice copies only itself)."""

    __slots__ = ("end", "tokens")

    def __init__(self, tokens: list[int], end: int) -> None:
        assert 0 <= end <= len(tokens), (end, len(tokens))
        self.tokens, self.end = tokens, end

    def __len__(self) -> int:
        return self.end

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.end)
            return self.tokens[start:stop] if step == 1 else self.tokens[: self.end][index]
        if not -self.end <= index < self.end:
            raise IndexError(index)
        return self.tokens[index % self.end]


@dataclass
class DraftPosition:
    """A drafted request as the sampler sees it at one of its positions: its tokens up to that position (the drafts
    before it counted as outputs), for the processors that read the outputs so far (penalties, min_tokens, bad
    words; workers/logits_processors.py)."""

    row: int
    token_ids: TokenPrefix
    """The request's own token list read up to the position (valid while the step is prepared)."""
    num_prompt_tokens: int
    params: Any
    logits_params: Any
    pending: list[int]
    """The drafts among ``token_ids``: not in the penalty tables' counts (they are counted once verified)."""

    @classmethod
    def of(cls, state: Any, num_drafts: int, j: int) -> "DraftPosition":
        """``state`` (its tokens ending with its ``num_drafts`` drafts) at the position after its ``j``-th draft."""
        end = len(state.token_ids) - num_drafts + j
        return cls(state.row, TokenPrefix(state.token_ids, end), state.num_prompt_tokens, state.params,
                   state.logits_params, state.token_ids[end - j : end])


def plan_drafted(
    req_ids: list[str], sample_indices: list[int], spec_token_ids: dict[str, list[int]], query_start_loc: np.ndarray
) -> tuple[list[DraftedRequest], np.ndarray]:
    """The drafted requests of a step and the token indices of their extra logits rows (after the usual ones)."""
    drafted, extra = [], []
    next_row = len(sample_indices)
    for sample, index in enumerate(sample_indices):
        drafts = spec_token_ids.get(req_ids[index])
        if drafts:
            k = len(drafts)
            end = int(query_start_loc[index + 1]) - 1  # the last position: its usual row
            extra.append(np.arange(end - k, end))
            drafted.append(DraftedRequest(sample, next_row, drafts))
            next_row += k
    return drafted, (np.concatenate(extra) if extra else np.zeros(0, np.int64))


def verify_drafts(sampled: list[int], drafted: list[DraftedRequest]) -> dict[int, list[int]]:
    """Each drafted request's output tokens (by sampling index): the accepted drafts, then one sampled token."""
    out = {}
    for request in drafted:
        tokens = []
        row = request.first_row
        for j, draft in enumerate(request.drafts):
            target = sampled[row + j]
            tokens.append(target)
            if target != draft:
                break
        else:
            tokens.append(sampled[request.sample])
        out[request.sample] = tokens
    return out


def exhausted_after_drafts(verified: dict[int, list[int]], exhausted_drafts: dict[int, int]) -> list[int]:
    """The drafted requests (by sampling index) whose verified tokens include one sampled from a row with no allowed
    token (the row after j drafts gives the (j + 1)th token): they fail, as without drafts, with no token sampled
    there."""
    return [sample for sample, j in exhausted_drafts.items() if len(verified[sample]) > j]


def exhausted_requests(req_ids: list[str], sample_indices: list[int], drafted: list[DraftedRequest],
                       exhausted: tuple[int, ...]) -> tuple[dict[str, str], dict[int, int]]:
    """The requests of `exhausted` logits rows that sample right after their committed tokens, with
    `EXHAUSTED_ERROR`; and the drafted requests with such a row after a draft (which may be rejected), by sampling
    index, with the number of drafts before their first one (`StepInputs.exhausted_drafts`)."""
    committed = dict(enumerate(sample_indices))  # logits row -> index into req_ids
    after_drafts: dict[int, tuple[int, int]] = {}  # logits row -> (sampling index, drafts before it)
    for request in drafted:  # its usual row follows its drafts; its first draft row follows its committed tokens
        del committed[request.sample]
        committed[request.first_row] = sample_indices[request.sample]
        after_drafts[request.sample] = (request.sample, len(request.drafts))
        after_drafts.update((request.first_row + j, (request.sample, j)) for j in range(1, len(request.drafts)))
    first: dict[int, int] = {}
    for sample, j in sorted(after_drafts[row] for row in exhausted if row in after_drafts):
        first.setdefault(sample, j)
    return {req_ids[committed[row]]: EXHAUSTED_ERROR for row in exhausted if row in committed}, first
