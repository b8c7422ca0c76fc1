"""Logits processors that change which token wins: allowed tokens, bad words, logit_bias, min_tokens, penalties.

They run on the raw logits of a step, before temperature and the top-k /
top-p / min-p filters, in vLLM's order: the allowed_token_ids mask, the bad
words (a word's last token set to -inf where the output ends with its other
tokens), logit_bias, then the min_tokens mask (EOS and stop_token_ids set to
-inf until enough tokens exist), then the repetition, frequency and presence
penalties. Greedy rows get them too.

Vectorised over the batch. What a request needs is precomputed once when the
worker learns about it (`RowLogitsParams`); each step gathers the sampling
rows that need anything into a few index tensors (`LogitsProcessorsMetadata`).
Penalties need token statistics: `PenaltyTables` keeps, per input-batch row,
a prompt-token mask and output-token counts on the device, initialised the
first time the row samples and then updated with each sampled token, so no
step recounts a sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from asyncllm.sampling import SamplingParams

__all__ = [
    "EXHAUSTED_ERROR",
    "array_to_device",
    "LogitsProcessorsMetadata",
    "PenaltyMetadata",
    "PenaltyTables",
    "RowLogitsParams",
    "apply_allowed_token_ids",
    "apply_logit_bias",
    "apply_logits_processors",
    "forbid_tokens",
    "apply_penalties",
    "build_logits_processors_metadata",
]


@dataclass
class RowLogitsParams:
    """One request's logits-processor settings, precomputed when its row is added."""

    bias_token_ids: np.ndarray | None
    """int64 token ids of logit_bias (None without it)."""
    bias_values: np.ndarray | None
    """float32 biases, aligned with ``bias_token_ids``."""
    min_tokens: int
    stop_token_ids: np.ndarray
    """int64: EOS ids and stop_token_ids, masked while outputs < min_tokens (with ignore_eos too, as vLLM's
    ``all_stop_token_ids``)."""
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    allowed_token_ids: np.ndarray | None = None
    """int64 ids that alone may be sampled (None: any)."""
    bad_words: tuple[tuple[tuple[int, ...], int], ...] = ()
    """(the tokens before, the token to forbid) of each bad word."""
    bad_words_span: int = 0
    """The most tokens before any bad word's last (how much of the output's tail `_banned_tokens` reads)."""
    penalty_tables_ready: bool = False
    """Whether `PenaltyTables` holds this row's statistics (set when first sent to be initialised)."""

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Sequence[int]) -> "RowLogitsParams | None":
        """None when the request needs none of these processors (the common case: no per-step cost)."""
        stop_ids = set(params.stop_token_ids) | set(eos_token_ids)
        min_tokens = params.min_tokens if stop_ids else 0
        row = cls(
            bias_token_ids=np.fromiter(params.logit_bias, np.int64) if params.logit_bias else None,
            bias_values=np.fromiter(params.logit_bias.values(), np.float32) if params.logit_bias else None,
            min_tokens=min_tokens,
            stop_token_ids=np.array(sorted(stop_ids), np.int64),
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            allowed_token_ids=(np.array(sorted(set(params.allowed_token_ids)), np.int64)
                               if params.allowed_token_ids else None),
            bad_words=tuple((tuple(ids[:-1]), ids[-1]) for ids in params.bad_words_token_ids),
            bad_words_span=max((len(ids) - 1 for ids in params.bad_words_token_ids), default=0),
        )
        needed = (row.bias_token_ids is not None or min_tokens > 0 or row.penalized
                  or row.allowed_token_ids is not None or row.bad_words)
        return row if needed else None


class RowState(Protocol):
    """What the metadata builder reads from a worker's request row (`input_types.RequestState`)."""

    row: int
    token_ids: Sequence[int]
    """Prompt then outputs: a list, or a drafted request's `TokenPrefix` (workers/spec_decode.py)."""
    num_prompt_tokens: int
    logits_params: RowLogitsParams | None


@dataclass
class PenaltyMetadata:
    """The penalized rows of one step."""

    rows: torch.Tensor
    """int64 indices into the step's logits rows."""
    table_rows: torch.Tensor
    """int64 rows of `PenaltyTables` (the input-batch rows)."""
    presence: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    repetition: torch.Tensor  # [R] float32
    fresh: list[tuple[int, list[int], int]]
    """(table row, token ids, num prompt tokens) of rows whose statistics must be (re)built first."""
    max_table_row: int
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    """(indices into ``rows``, token ids): drafts counted as outputs at a drafted request's later positions."""
    recorded: torch.Tensor | None = None
    """Indices into ``rows`` whose sampled tokens the sampler counts (None: every row); a drafted request's are
    counted once verified (`PenaltyTables.record_tokens`)."""


EXHAUSTED_ERROR = ("allowed_token_ids: bad_words (or EOS and stop tokens while min_tokens holds) forbid every "
                   "allowed token after this output, so none is left to sample: allow more tokens, or drop bad_words")
"""The error of a request with no allowed token left (`LogitsProcessorsMetadata.exhausted`)."""


@dataclass
class LogitsProcessorsMetadata:
    """Index tensors of one step; a processor that no row uses is None."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """(logits rows, token ids, values)."""
    min_tokens: tuple[torch.Tensor, torch.Tensor] | None
    """(logits rows, token ids) to set to -inf."""
    penalties: PenaltyMetadata | None
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(logits rows, each row once; the rows repeated per id; the allowed ids)."""
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """(logits rows, token ids) the bad words forbid this step."""
    exhausted: tuple[int, ...] = ()
    """Logits rows whose allowed_token_ids the bad words and min_tokens all forbid this step: they have no token
    left to sample (the sampler would pick one outside the allowed set), so their requests fail (input_batch.py)."""


def build_logits_processors_metadata(
    states: Sequence[RowState], device: torch.device
) -> LogitsProcessorsMetadata | None:
    """Gather the processors of the sampling rows `states` (logits row i is states[i])."""
    bias: list[tuple[int, RowLogitsParams]] = []
    masked: list[tuple[int, RowLogitsParams]] = []
    penalized: list[tuple[int, RowState, RowLogitsParams]] = []
    allowed: list[tuple[int, RowLogitsParams]] = []
    banned: list[tuple[int, int]] = []
    exhausted: list[int] = []
    for i, state in enumerate(states):
        params = state.logits_params
        if params is None:
            continue
        row_banned = _banned_tokens(state, params) if params.bad_words else []
        banned += [(i, token) for token in row_banned]
        if params.bias_token_ids is not None:
            bias.append((i, params))
        holds_min_tokens = len(state.token_ids) - state.num_prompt_tokens < params.min_tokens
        if holds_min_tokens:
            masked.append((i, params))
        if params.allowed_token_ids is not None:
            allowed.append((i, params))
            if (row_banned or holds_min_tokens) and _allows_none(params, row_banned, holds_min_tokens):
                exhausted.append(i)
        if params.penalized:
            penalized.append((i, state, params))
    if not (bias or masked or penalized or allowed or banned):
        return None
    return LogitsProcessorsMetadata(
        bias=_bias_indices(bias, device) if bias else None,
        min_tokens=_min_tokens_indices(masked, device) if masked else None,
        penalties=_penalty_metadata(penalized, device) if penalized else None,
        allowed=_allowed_indices(allowed, device) if allowed else None,
        banned=(array_to_device(np.array([i for i, _ in banned], np.int64), device),
                array_to_device(np.array([t for _, t in banned], np.int64), device)) if banned else None,
        exhausted=tuple(exhausted),
    )


def _allows_none(params: RowLogitsParams, banned: list[int], holds_min_tokens: bool) -> bool:
    """Whether this step's bad words (and EOS and stop ids while min_tokens holds) forbid every allowed token."""
    assert params.allowed_token_ids is not None
    forbidden = set(banned)
    if holds_min_tokens:
        forbidden.update(params.stop_token_ids.tolist())
    return len(params.allowed_token_ids) <= len(forbidden) and forbidden.issuperset(params.allowed_token_ids.tolist())


def _banned_tokens(state: RowState, params: RowLogitsParams) -> list[int]:
    """The last tokens of the bad words whose other tokens end the output so far (vLLM's: the output's own tokens,
    never the prompt's). Reads only the output's last tokens, as many as the longest word's before."""
    num_tokens = len(state.token_ids)
    num_outputs = num_tokens - state.num_prompt_tokens
    tail = tuple(state.token_ids[num_tokens - min(num_outputs, params.bad_words_span):])
    return [last for before, last in params.bad_words
            if len(before) <= num_outputs and (not before or tail[-len(before):] == before)]


def _allowed_indices(rows: list[tuple[int, RowLogitsParams]], device: torch.device) -> tuple[torch.Tensor, ...]:
    ids = [p.allowed_token_ids for _, p in rows]
    row_idx = np.array([i for i, _ in rows], np.int64)
    repeated = np.repeat(row_idx, [len(a) for a in ids])  # type: ignore[arg-type]
    return array_to_device(row_idx, device), array_to_device(repeated, device), array_to_device(np.concatenate(ids), device)  # type: ignore[arg-type]


def _bias_indices(rows: list[tuple[int, RowLogitsParams]], device: torch.device) -> tuple[torch.Tensor, ...]:
    ids = [p.bias_token_ids for _, p in rows]
    counts = [len(a) for a in ids]  # type: ignore[arg-type]
    row_idx = np.repeat(np.array([i for i, _ in rows], np.int64), counts)
    return (
        array_to_device(row_idx, device),
        array_to_device(np.concatenate(ids), device),  # type: ignore[arg-type]
        array_to_device(np.concatenate([p.bias_values for _, p in rows]), device),  # type: ignore[misc]
    )


def _min_tokens_indices(rows: list[tuple[int, RowLogitsParams]], device: torch.device) -> tuple[torch.Tensor, ...]:
    counts = [len(p.stop_token_ids) for _, p in rows]
    row_idx = np.repeat(np.array([i for i, _ in rows], np.int64), counts)
    return array_to_device(row_idx, device), array_to_device(np.concatenate([p.stop_token_ids for _, p in rows]), device)


def _penalty_metadata(rows: list[tuple[int, RowState, RowLogitsParams]], device: torch.device) -> PenaltyMetadata:
    fresh, pending_at, pending_ids, recorded = [], [], [], []
    for at, (_, state, params) in enumerate(rows):
        pending = getattr(state, "pending", None)  # a drafted request's position (workers/spec_decode.py)
        if pending is None:
            recorded.append(at)
        else:
            pending_at += [at] * len(pending)
            pending_ids += pending
        if not params.penalty_tables_ready:
            committed = len(state.token_ids) - len(pending or ())
            fresh.append((state.row, list(state.token_ids[:committed]), state.num_prompt_tokens))
            params.penalty_tables_ready = True
    table_rows = np.array([s.row for _, s, _ in rows], np.int64)
    return PenaltyMetadata(
        rows=array_to_device(np.array([i for i, _, _ in rows], np.int64), device),
        table_rows=array_to_device(table_rows, device),
        presence=array_to_device(np.array([p.presence_penalty for _, _, p in rows], np.float32), device),
        frequency=array_to_device(np.array([p.frequency_penalty for _, _, p in rows], np.float32), device),
        repetition=array_to_device(np.array([p.repetition_penalty for _, _, p in rows], np.float32), device),
        fresh=fresh,
        max_table_row=int(table_rows.max()),
        pending=(array_to_device(np.array(pending_at, np.int64), device),
                 array_to_device(np.array(pending_ids, np.int64), device)) if pending_ids else None,
        recorded=None if len(recorded) == len(rows) else array_to_device(np.array(recorded, np.int64), device),
    )


def array_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``, copied without waiting (workers/generation_rules.py builds its rows so too)."""
    return torch.from_numpy(array).to(device, non_blocking=True)


# ------------------------------------------------------------------ the processors (pure functions)
def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor, repeated_rows: torch.Tensor,
                            token_ids: torch.Tensor) -> None:
    """Set every logit of `rows` to -inf except at (repeated_rows, token_ids), in place."""
    kept = logits[repeated_rows, token_ids]
    logits.index_fill_(0, rows, float("-inf"))
    logits.index_put_((repeated_rows, token_ids), kept)


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor) -> None:
    """Add ``values`` at (rows, token_ids), in place."""
    logits.index_put_((rows, token_ids), values, accumulate=True)


def forbid_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Set (rows, token_ids) to -inf, in place: bad words' last tokens, stop tokens before min_tokens."""
    logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of ``logits`` [R, V] given each row's prompt mask and output counts [R, V].

    Repetition (HF / CTRL): a token seen in the prompt or the output has its
    logit divided by the penalty when positive, multiplied when negative.
    Frequency and presence (OpenAI): ``logit -= count * frequency + (count > 0) * presence``
    over output tokens only.
    """
    output_mask = output_counts > 0
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | output_mask, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * output_mask


class PenaltyTables:
    """Per-row prompt masks [rows, V] (bool) and output counts [rows, V] (int32), on the device.

    Allocated when the first penalized request samples; grown when a row
    index exceeds them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, meta: PenaltyMetadata) -> None:
        """Penalise the rows of ``meta`` in place (initialising fresh rows first)."""
        self._ensure(meta.max_table_row + 1, logits.shape[1])
        assert self.prompt_mask is not None and self.output_counts is not None
        for table_row, token_ids, num_prompt in meta.fresh:
            self._init_row(table_row, token_ids, num_prompt)
        every_row = meta.rows.shape[0] == logits.shape[0]  # rows are increasing: then they are all, in order
        rows = logits if every_row else logits.index_select(0, meta.rows)
        counts = self.output_counts.index_select(0, meta.table_rows)
        if meta.pending is not None:  # the drafts before a drafted request's position are outputs there
            at, ids = meta.pending
            counts.index_put_((at, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        penalized = apply_penalties(rows, self.prompt_mask.index_select(0, meta.table_rows), counts, meta.presence,
                                    meta.frequency, meta.repetition)
        if every_row:
            logits.copy_(penalized)
        else:
            logits.index_copy_(0, meta.rows, penalized)

    def record(self, meta: PenaltyMetadata, sampled: torch.Tensor) -> None:
        """Count each penalized row's sampled token (``sampled`` holds one id per logits row), but a drafted
        request's (`record_tokens`, once verified)."""
        assert self.output_counts is not None
        rows, table_rows = meta.rows, meta.table_rows
        if meta.recorded is not None:
            rows, table_rows = rows.index_select(0, meta.recorded), table_rows.index_select(0, meta.recorded)
        tokens = sampled.index_select(0, rows)
        ones = torch.ones_like(tokens, dtype=torch.int32)
        self.output_counts.index_put_((table_rows, tokens), ones, accumulate=True)

    def record_tokens(self, table_row: int, tokens: list[int]) -> None:
        """Count a drafted request's verified output tokens."""
        assert self.output_counts is not None
        ids = torch.tensor(tokens, dtype=torch.int64).to(self.device, non_blocking=True)
        self.output_counts[table_row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def _init_row(self, row: int, token_ids: list[int], num_prompt: int) -> None:
        assert self.prompt_mask is not None and self.output_counts is not None
        ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        self.prompt_mask[row].zero_()
        self.prompt_mask[row].index_fill_(0, ids[:num_prompt], True)
        self.output_counts[row].zero_()
        outputs = ids[num_prompt:]
        self.output_counts[row].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))

    def _ensure(self, num_rows: int, vocab_size: int) -> None:
        old = 0 if self.prompt_mask is None else self.prompt_mask.shape[0]
        if old >= num_rows:
            return
        new = max(num_rows, 2 * old, 8)
        mask = torch.zeros((new, vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros((new, vocab_size), dtype=torch.int32, device=self.device)
        if self.prompt_mask is not None and self.output_counts is not None:
            mask[:old] = self.prompt_mask
            counts[:old] = self.output_counts
        self.prompt_mask, self.output_counts = mask, counts


def apply_logits_processors(logits: torch.Tensor, meta: LogitsProcessorsMetadata, tables: PenaltyTables) -> None:
    """The allowed-ids mask, bad words, logit_bias, the min_tokens mask, then penalties; in place on ``logits`` [N, V]."""
    if meta.allowed is not None:
        apply_allowed_token_ids(logits, *meta.allowed)
    if meta.banned is not None:
        forbid_tokens(logits, *meta.banned)
    if meta.bias is not None:
        apply_logit_bias(logits, *meta.bias)
    if meta.min_tokens is not None:
        forbid_tokens(logits, *meta.min_tokens)
    if meta.penalties is not None:
        tables.apply(logits, meta.penalties)
