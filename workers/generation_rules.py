"""The model's own generation rules, from its ``generation_config.json`` (the one the engine's ``generation_config``
field names: asyncllm/generation_config.py; ``vllm``: none), applied to every request as transformers'
``generate`` applies them: ``suppress_tokens`` never sampled, ``begin_suppress_tokens`` not sampled at a request's
first generated position, and Whisper's timestamp rules for the requests that predict timestamps.

Whisper's timestamps (``no_timestamps_token_id``: the ids after it are ``<|0.00|>``, ``<|0.02|>``, ... ; whether a
checkpoint has them is decided once for the host and the workers: `asyncllm.generation_config.timestamp_rules`). A
request predicts them when its prompt ends with the task token (``<|transcribe|>`` / ``<|translate|>``; on an
English-only checkpoint, ``<|startoftranscript|>``), the prompt of openai-whisper's and transformers'
``return_timestamps=True`` without ``<|notimestamps|>``. Its rules, transformers' ``WhisperTimeStampLogitsProcessor``
to the token: ``<|notimestamps|>`` is never sampled; the first token is a timestamp of at most
``max_initial_timestamp_index``; after a timestamp that follows text comes a timestamp or an id from EOS on; after two
timestamps (or one at the start) comes no timestamp; timestamps never decrease (after a pair, they increase); and
where the timestamps' summed probability (after the rules above: a log-softmax of the row) beats every other token's,
only a timestamp may come.

Cost: the masks are built once on the device (the suppressed ids, the begin ids, a vocabulary ``arange``). A step
sends the rows at their first position (one small index copy) and, for timestamp rows, three bounds per row computed
on the host from the row's output tokens (the rows need their tokens on the host, as bad words do); nothing waits
for the device. The model runner builds the rules when it loads the model (`GenerationRules.of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from asyncllm.generation_config import (SuppressedTokens, TimestampRules, read_generation_config, rule_keys_of,
                                        source_of, timestamp_rules)
from asyncllm.workers.logits_processors import array_to_device

__all__ = ["GenerationRules", "RulesStep"]


class RuleRow(Protocol):
    """What the rules read from a worker's request row (`input_types.RequestState`)."""

    row: int
    token_ids: Sequence[int]
    """A list, or a drafted request's `TokenPrefix` (workers/spec_decode.py)."""
    num_prompt_tokens: int


@dataclass
class RulesStep:
    """One step's rows for the rules (indices into the step's logits rows); a part no row needs is None."""

    rules: GenerationRules
    begin_rows: torch.Tensor | None = None
    timestamp_rows: torch.Tensor | None = None
    bounds: torch.Tensor | None = None
    """[R, 3] int64: `TimestampRules.bounds` of each timestamp row."""

    def apply(self, logits: torch.Tensor) -> None:
        self.rules.apply(logits, self)


class GenerationRules:
    """A model's suppressed ids and timestamp rules, with its masks on the device and the requests that predict
    timestamps."""

    def __init__(self, suppress: Sequence[int], begin_suppress: Sequence[int], timestamps: TimestampRules | None,
                 device: torch.device) -> None:
        self.device = device
        self.timestamps = timestamps
        self._suppress = torch.tensor(sorted(set(suppress)), dtype=torch.int64, device=device) if suppress else None
        self._begin = (torch.tensor(sorted(set(begin_suppress)), dtype=torch.int64, device=device)
                       if begin_suppress else None)
        self._suppress_mask: torch.Tensor | None = None
        self._vocab: torch.Tensor | None = None
        self.timestamp_rows: set[int] = set()
        """The input-batch rows of the requests whose prompt asks for timestamps."""

    @classmethod
    def of(cls, generation_config: str, model_path: str, vocab_size: int | None,
           device: torch.device, model_config: object = None) -> "GenerationRules | None":
        """The rules of the generation_config.json that the engine's ``generation_config`` field names for the
        checkpoint at ``model_path`` (asyncllm/generation_config.py: the model folder's for ``vllm`` too; a folder
        without one: `model_config`'s ``suppress_tokens``, read without transformers: `rule_keys_of`; None when it
        sets none). Its suppressed ids are the host's (`SuppressedTokens.of`: a malformed list is a `ConfigError`)."""
        if vocab_size is None:
            return None
        config = read_generation_config(generation_config, model_path, model_config, fallback=rule_keys_of)
        suppressed = SuppressedTokens.of(config, vocab_size, source_of(generation_config, model_path))  # as the host
        timestamps = timestamp_rules(config, vocab_size)
        if not suppressed.always and not suppressed.at_start and timestamps is None:
            return None
        return cls(sorted(suppressed.always), sorted(suppressed.at_start), timestamps, device)

    # ------------------------------------------------------------ rows (host)
    def add(self, row: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """A request in input-batch ``row``: it predicts timestamps when its prompt ends so."""
        ts = self.timestamps
        if ts is not None and num_prompt_tokens and token_ids[num_prompt_tokens - 1] in ts.prompt_ends:
            self.timestamp_rows.add(row)

    def discard(self, row: int) -> None:
        self.timestamp_rows.discard(row)

    def step(self, rows: Sequence[RuleRow], positions: Sequence[int]) -> RulesStep | None:
        """The rules' rows of a step whose logits row i samples position ``positions[i]`` of ``rows[i]``."""
        if self._begin is None and not self.timestamp_rows:  # the suppressed ids alone: no row to look at
            return None if self._suppress is None else RulesStep(self)
        begin: list[int] = []
        stamped: list[int] = []
        bounds: list[tuple[int, int, int]] = []
        for i, (row, position) in enumerate(zip(rows, positions)):
            if position == row.num_prompt_tokens:
                begin.append(i)
            if row.row in self.timestamp_rows:
                assert self.timestamps is not None
                stamped.append(i)
                bounds.append(self.timestamps.bounds(row.token_ids[row.num_prompt_tokens:position]))
        step = RulesStep(self, self._rows(begin) if begin and self._begin is not None else None)
        if stamped:
            step.timestamp_rows, step.bounds = self._rows(stamped), array_to_device(np.array(bounds, np.int64), self.device)
        if self._suppress is None and step.begin_rows is None and step.timestamp_rows is None:
            return None
        return step

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return array_to_device(np.array(rows, np.int64), self.device)

    # ------------------------------------------------------------ logits (device)
    def apply(self, logits: torch.Tensor, step: RulesStep) -> None:
        """The suppressed ids of every row, the begin ids of the rows at their first position, then the timestamp
        rules, in place on ``logits`` [N, V] (transformers' order)."""
        if self._suppress is not None:
            logits.masked_fill_(self._mask(logits.shape[1]), float("-inf"))
        if step.begin_rows is not None:
            assert self._begin is not None
            logits[step.begin_rows.unsqueeze(1), self._begin] = float("-inf")
        if step.timestamp_rows is not None:
            assert step.bounds is not None
            rows = logits.index_select(0, step.timestamp_rows)
            logits.index_copy_(0, step.timestamp_rows, self._timestamp_rules(rows, step.bounds))

    def _timestamp_rules(self, rows: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        ts = self.timestamps
        assert ts is not None
        vocab, begin = self._arange(rows.shape[1]), ts.timestamp_begin
        text_below, low, top = bounds[:, 0:1], bounds[:, 1:2], bounds[:, 2:3]
        banned = ((vocab < text_below) | ((vocab >= begin) & (vocab < low)) | (vocab >= top)
                  | (vocab == ts.no_timestamps_id))
        rows = rows.masked_fill(banned, float("-inf"))
        logprobs = rows.float().log_softmax(dim=-1)  # as transformers: the sum over the timestamps after the rules
        timestamp_wins = logprobs[:, begin:].logsumexp(dim=-1) > logprobs[:, :begin].max(dim=-1).values
        rows[:, :begin].masked_fill_(timestamp_wins.unsqueeze(1), float("-inf"))
        return rows

    def _mask(self, vocab_size: int) -> torch.Tensor:
        if self._suppress_mask is None or self._suppress_mask.shape[0] != vocab_size:
            assert self._suppress is not None
            self._suppress_mask = torch.isin(self._arange(vocab_size), self._suppress)
        return self._suppress_mask

    def _arange(self, vocab_size: int) -> torch.Tensor:
        if self._vocab is None or self._vocab.shape[0] != vocab_size:
            self._vocab = torch.arange(vocab_size, device=self.device)
        return self._vocab
