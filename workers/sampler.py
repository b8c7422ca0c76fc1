"""Turn the logits of one step into token ids, one per sampling request.

Vectorised over the batch: first the logprobs of the raw logits for rows that
asked (`workers/logprobs.py`), then logit_bias, the min_tokens mask and the
penalties for every row that has them (`workers/logits_processors.py`), and the model's generation_config rules
(suppressed ids, Whisper's timestamps: `workers/generation_rules.py`); then
greedy rows take the argmax; random rows are divided by their temperature,
filtered by min-p, then top-k and top-p (vLLM's order), and sampled with the exponential race
(``argmax(probs / q)`` with ``q ~ Exp(1)``, which draws from ``probs`` exactly).

Reproducibility. The noise ``q`` of a request with a ``seed`` comes from a
generator seeded with a mix of (seed, position of the token being sampled),
so its tokens do not depend on what else is in the batch, on which step it
runs in, or on being preempted and recomputed. The position (the index the
new token will have in the sequence) is used rather than the output index
because it is the same number whoever counts the prompt. Unseeded requests
draw from one worker generator seeded with the engine seed: every tensor
parallel rank sees the same logits and makes the same calls in the same
order, so ranks agree on every token without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from asyncllm.protocol import LogprobsArrays
from asyncllm.sampling import SamplingParams
from asyncllm.workers.logits_processors import (
    LogitsProcessorsMetadata,
    PenaltyTables,
    RowLogitsParams,
    apply_logits_processors,
    build_logits_processors_metadata,
)
from asyncllm.workers.generation_rules import RulesStep
from asyncllm.workers.logprobs import LogprobsMetadata, sampled_logprobs

__all__ = [
    "GREEDY_EPS", "Sampler", "SamplerOutput", "SamplingMetadata", "mix_seed", "apply_top_k_top_p", "apply_min_p",
]

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy: dividing by them would overflow float32."""

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, token position) (splitmix64 finaliser).

    Nearby seeds and positions give unrelated streams, unlike ``seed + position``.
    """
    x = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step, already on the device.

    Rows follow the logits rows. Only the random (non-greedy) rows carry
    filter tensors; a filter that no row uses is None so that the sort it
    would need is skipped.
    """

    num_rows: int
    random_rows: torch.Tensor | None
    """Indices of the non-greedy rows (int64); None when every row is greedy."""
    all_random: bool
    temperature: torch.Tensor | None  # [R] float32, random rows only
    top_k: torch.Tensor | None  # [R] int64, vocab-size means off
    top_p: torch.Tensor | None  # [R] float32
    min_p: torch.Tensor | None  # [R] float32
    seeds: list[int | None]  # [R]
    positions: list[int]  # [R] index of the token each random row samples
    logits_processors: LogitsProcessorsMetadata | None = None
    """logit_bias / min_tokens / penalties of all rows (greedy ones too); None when no row has any."""
    logprobs: LogprobsMetadata | None = None
    """Rows that return logprobs; None when none does."""
    generation_rules: RulesStep | None = None
    """The model's suppressed ids and timestamp rules (workers/generation_rules.py), after the processors above."""

    @property
    def argmax_only(self) -> bool:
        """Every row greedy, nothing changes the logits (processors, generation rules) and no logprobs: the tokens
        are the logits' argmax (what a decode graph with the LM head computes: workers/cuda_graphs.py)."""
        return (self.random_rows is None and self.logits_processors is None and self.logprobs is None
                and self.generation_rules is None)

    @classmethod
    def greedy(cls, num_rows: int, logits_processors: LogitsProcessorsMetadata | None = None,
               logprobs: LogprobsMetadata | None = None) -> "SamplingMetadata":
        """Every row greedy (temperature below `GREEDY_EPS`)."""
        return cls(num_rows, None, False, None, None, None, None, [], [], logits_processors, logprobs)

    @classmethod
    def from_arrays(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        min_p: np.ndarray,
        seeds: Sequence[int | None],
        positions: Sequence[int],
        device: torch.device,
        logits_processors: LogitsProcessorsMetadata | None = None,
        logprobs: LogprobsMetadata | None = None,
    ) -> "SamplingMetadata":
        """Build from per-row host arrays (top_k <= 0 means off)."""
        num_rows = len(temperature)
        random = (temperature >= GREEDY_EPS).nonzero()[0]
        if len(random) == 0:
            return cls.greedy(num_rows, logits_processors, logprobs)
        top_k, top_p, min_p = top_k[random], top_p[random], min_p[random]
        return cls(
            num_rows=num_rows,
            random_rows=_to_device(random.astype(np.int64), device),
            all_random=len(random) == num_rows,
            temperature=_to_device(temperature[random].astype(np.float32), device),
            top_k=_to_device(top_k.astype(np.int64), device) if (top_k > 0).any() else None,
            top_p=_to_device(top_p.astype(np.float32), device) if (top_p < 1.0).any() else None,
            min_p=_to_device(min_p.astype(np.float32), device) if (min_p > 0.0).any() else None,
            seeds=[seeds[i] for i in random],
            positions=[int(positions[i]) for i in random],
            logits_processors=logits_processors,
            logprobs=logprobs,
        )

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> "SamplingMetadata":
        """Build from one `SamplingParams` per row (tests); row i has ``prompt_token_ids[i]``
        then ``output_token_ids[i]`` (for penalties and min_tokens; empty by default).

        Penalty statistics live in the `Sampler`'s table row of the same index:
        use a fresh `Sampler` per call.
        """
        prompts = prompt_token_ids if prompt_token_ids is not None else [[] for _ in params]
        outputs = output_token_ids if output_token_ids is not None else [[] for _ in params]
        rows = [_TestRow(i, [*prompt, *out], len(prompt), RowLogitsParams.from_params(p, eos_token_ids))
                for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs))]
        return cls.from_arrays(
            np.array([p.temperature for p in params], np.float32),
            np.array([p.top_k for p in params], np.int64),
            np.array([p.top_p for p in params], np.float32),
            np.array([p.min_p for p in params], np.float32),
            [p.seed for p in params],
            positions,
            device,
            build_logits_processors_metadata(rows, device),
            LogprobsMetadata.build([p.logprobs for p in params], device, [p.logprobs_mode for p in params]),
        )


@dataclass
class _TestRow:
    """A request row for `SamplingMetadata.from_params` (the input batch uses its own)."""

    row: int
    token_ids: list[int]
    num_prompt_tokens: int
    logits_params: RowLogitsParams | None


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[N] int64, one per logits row."""
    logprobs: list[LogprobsArrays] | None = None
    """One per row of `SamplingMetadata.logprobs`, in its order."""


class Sampler:
    """Samples one token per logits row; owns the worker's unseeded generator and penalty tables."""

    def __init__(self, seed: int, device: torch.device, logprobs_mode: str = "raw_logprobs") -> None:
        self.device = device
        self.logprobs_mode = logprobs_mode
        """``raw_*``: logprobs (or logits) of the model's logits; ``processed_*``: of those a token is drawn from."""
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded_generator = torch.Generator(device=device)
        self.penalty_tables = PenaltyTables(device)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits`` [N, V] float32 -> one token id per row, and logprobs where asked.

        ``logits`` is modified in place when a row has logit_bias, min_tokens or penalties.
        """
        assert logits.shape[0] == metadata.num_rows, (logits.shape, metadata.num_rows)
        wanted = metadata.logprobs
        modes = None if wanted is None else wanted.row_modes(self.logprobs_mode)
        raw = None
        if modes is not None and not all(mode.startswith("processed") for mode in modes):
            raw = logits.index_select(0, wanted.rows)  # a copy: before the processors change the logits
        processors = metadata.logits_processors
        if processors is not None:
            apply_logits_processors(logits, processors, self.penalty_tables)
        if metadata.generation_rules is not None:
            metadata.generation_rules.apply(logits)
        keep = modes is not None and any(mode.startswith("processed") for mode in modes)
        tokens, drawn_from = self._sample(logits, metadata, keep=keep)
        if processors is not None and processors.penalties is not None:
            self.penalty_tables.record(processors.penalties, tokens)
        if wanted is None or modes is None:
            return SamplerOutput(tokens)
        processed = None if drawn_from is None else drawn_from.index_select(0, wanted.rows)
        return SamplerOutput(tokens, sampled_logprobs(_logprobs_values(raw, processed, modes), tokens, wanted))

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
                keep: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(one token per row, with ``keep`` the logits each was drawn from: greedy rows' as given, sampled rows'
        after temperature, min-p, top-k and top-p)."""
        if metadata.random_rows is None:
            return logits.argmax(dim=-1), logits if keep else None
        rows = logits if metadata.all_random else logits.index_select(0, metadata.random_rows)
        sampled, drawn_from = self._sample_random(rows, metadata)
        if metadata.all_random:
            return sampled, drawn_from if keep else None
        tokens = logits.argmax(dim=-1)
        tokens.index_copy_(0, metadata.random_rows, sampled)
        return tokens, logits.index_copy(0, metadata.random_rows, drawn_from) if keep else None

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        assert metadata.temperature is not None
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:  # vLLM's order: min-p, then top-k / top-p over what min-p kept
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        noise = self._exponential_noise(probs.shape, metadata.seeds, metadata.positions)
        return probs.div_(noise).argmax(dim=-1), logits

    def _exponential_noise(
        self, shape: torch.Size, seeds: list[int | None], positions: list[int]
    ) -> torch.Tensor:
        """Exp(1) noise: per-(seed, position) streams for seeded rows, the worker stream for the rest."""
        noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        if all(seed is None for seed in seeds):
            noise.exponential_(generator=self.generator)
        else:
            unseeded = [i for i, seed in enumerate(seeds) if seed is None]
            if unseeded:
                draw = torch.empty((len(unseeded), shape[1]), dtype=torch.float32, device=self.device)
                draw.exponential_(generator=self.generator)
                noise[unseeded] = draw
            for i, (seed, position) in enumerate(zip(seeds, positions)):
                if seed is not None:
                    self._seeded_generator.manual_seed(mix_seed(seed, position))
                    noise[i].exponential_(generator=self._seeded_generator)
        # Exp(1) can round to 0; a floor keeps probs / noise finite (0 / tiny stays 0).
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus.

    One ascending sort serves both filters. Ties at the k-th value are all
    kept; the most likely token always survives top-p.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp_(1, vocab_size)
        kth_value = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_value, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        # A row with top_p 1 keeps every token, also those whose probability rounds to 0 (its -inf would depend
        # on another row in the batch setting top_p).
        drop = (cumulative <= (1.0 - top_p).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _logprobs_values(raw: torch.Tensor | None, processed: torch.Tensor | None, modes: list[str]) -> torch.Tensor:
    """What each logprobs row holds, by its mode: of the ``raw`` logits (before any processor) or the ``processed``
    ones (those its token was drawn from), as log-softmax or (``*_logits``) as they are."""
    if raw is None or processed is None:
        values = raw if processed is None else processed
    else:
        values = torch.where(_row_mask([m.startswith("processed") for m in modes], raw.device), processed, raw)
    as_logprobs = [mode.endswith("logprobs") for mode in modes]
    if not any(as_logprobs):
        return values
    if all(as_logprobs):
        return values.log_softmax(dim=-1)
    return torch.where(_row_mask(as_logprobs, values.device), values.log_softmax(dim=-1), values)


def _row_mask(flags: list[bool], device: torch.device) -> torch.Tensor:
    return torch.tensor(flags, dtype=torch.bool).to(device, non_blocking=True).unsqueeze(1)
