"""Logprobs on the worker: of sampled tokens, and of prompt tokens during prefill.

Logprobs are those of the model's raw distribution, ``log_softmax(logits)``
before logit_bias, penalties, temperature and the min-p/top-k/top-p filters
(vLLM's default "raw_logprobs"), so they match what transformers' logits give.
For each position the worker returns its own token (sampled, or the prompt
token) with its logprob and rank (the number of tokens at least as likely,
so the top token has rank 1), then the top-N tokens. Results travel packed as
`protocol.LogprobsArrays`; the host decodes them into `Logprob` objects.

Prompt logprobs: the logits at prompt position j give the logprob of prompt
token j + 1, so a prefill chunk covering positions [c, c + k) yields the rows
of prompt tokens c + 1 .. min(c + k, P - 1). Prompt token 0 has none. Logits
are computed in slices so a long chunk never materialises [k, vocab] at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.protocol import LogprobsArrays

__all__ = [
    "LogprobsMetadata",
    "PromptLogprobsJob",
    "compute_prompt_logprobs",
    "join_logprobs",
    "pack_logprobs",
    "plan_prompt_logprobs",
    "sampled_logprobs",
    "token_logprobs",
    "whole_vocabulary",
]

PROMPT_LOGITS_SLICE = 256
"""Prompt positions whose logits are computed at once (bounds a [slice, vocab] float32 buffer)."""


@dataclass
class LogprobsMetadata:
    """The sampling rows of one step that asked for logprobs."""

    rows: torch.Tensor
    """int64 indices into the step's logits rows."""
    num_logprobs: list[int]
    """Top-N of each such row (0: the sampled token only; -1: the whole vocabulary)."""
    row_indices: list[int]
    """``rows`` as host ints: positions in the step's sampling order."""
    modes: list[str | None] | None = None
    """Each such row's `SamplingParams.logprobs_mode` (None: the engine's); None when no row sets one."""

    @classmethod
    def build(cls, num_logprobs: Sequence[int | None], device: torch.device,
              modes: Sequence[str | None] = ()) -> "LogprobsMetadata | None":
        """From each sampling row's `SamplingParams.logprobs` (None: not asked) and ``logprobs_mode``."""
        row_indices = [i for i, n in enumerate(num_logprobs) if n is not None]
        if not row_indices:
            return None
        rows = torch.tensor(row_indices, dtype=torch.int64).to(device, non_blocking=True)
        row_modes = [modes[i] for i in row_indices] if any(modes) else None
        return cls(rows, [int(num_logprobs[i]) for i in row_indices], row_indices, row_modes)  # type: ignore[arg-type]

    def row_modes(self, engine_mode: str) -> list[str]:
        """Each row's logprobs mode, the engine's where the request sets none."""
        if self.modes is None:
            return [engine_mode] * len(self.row_indices)
        return [mode or engine_mode for mode in self.modes]


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logprobs [R, V] and one token per row: (ids [R, 1+k], logprobs [R, 1+k], ranks [R]).

    Column 0 is the row's own token, then the top ``num_top`` tokens (-1: every token, as vLLM's ``logprobs=-1``).
    """
    num_top = whole_vocabulary(num_top, logprobs.shape[-1])
    own = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= own).sum(dim=-1)
    if num_top == 0:
        return token_ids.unsqueeze(1), own, ranks
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return torch.cat([token_ids.unsqueeze(1), top_ids], 1), torch.cat([own, top_values], 1), ranks


def whole_vocabulary(num_logprobs: int, vocab_size: int) -> int:
    """A request's top-N count with -1 (the whole vocabulary) read as ``vocab_size``."""
    return vocab_size if num_logprobs == -1 else num_logprobs


def pack_logprobs(ids: np.ndarray, values: np.ndarray, ranks: np.ndarray, start: int = 0) -> LogprobsArrays:
    """Pack host arrays (one request's rows) into the wire struct."""
    return LogprobsArrays(
        width=int(ids.shape[1]),
        token_ids=np.ascontiguousarray(ids, dtype="<i4").tobytes(),
        logprobs=np.ascontiguousarray(values, dtype="<f4").tobytes(),
        ranks=np.ascontiguousarray(ranks, dtype="<i4").tobytes(),
        start=start,
    )


def join_logprobs(parts: Sequence[LogprobsArrays]) -> LogprobsArrays:
    """One request's rows of several positions (each part one or more rows, the same width), in order."""
    return LogprobsArrays(width=parts[0].width, token_ids=b"".join(p.token_ids for p in parts),
                          logprobs=b"".join(p.logprobs for p in parts), ranks=b"".join(p.ranks for p in parts))


def sampled_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, meta: LogprobsMetadata
) -> list[LogprobsArrays]:
    """One packed row per asking request: ``raw_logprobs`` [len(meta.rows), V], ``sampled`` [N] all rows."""
    tokens = sampled.index_select(0, meta.rows)
    widths = [1 + whole_vocabulary(n, raw_logprobs.shape[-1]) for n in meta.num_logprobs]
    ids, values, ranks = token_logprobs(raw_logprobs, tokens, max(widths) - 1)
    ids_np, values_np, ranks_np = ids.cpu().numpy(), values.cpu().numpy(), ranks.cpu().numpy()
    return [
        pack_logprobs(ids_np[r : r + 1, :width], values_np[r : r + 1, :width], ranks_np[r : r + 1])
        for r, width in enumerate(widths)
    ]


# ------------------------------------------------------------------ prompt logprobs
@dataclass
class PromptLogprobsJob:
    """The prompt logprobs one request gets from one step."""

    req_id: str
    flat_start: int
    """Index in the flattened step of the first position whose logits are used."""
    target_token_ids: list[int]
    """The prompt tokens those positions predict, in order."""
    start: int
    """Prompt index of the first target token."""
    num_logprobs: int


def plan_prompt_logprobs(
    req_id: str, token_ids: list[int], num_prompt_tokens: int, num_computed: int, num_scheduled: int,
    flat_start: int, num_logprobs: int,
) -> PromptLogprobsJob | None:
    """The job of a request whose step covers positions [num_computed, num_computed + num_scheduled)."""
    end = min(num_computed + num_scheduled, num_prompt_tokens - 1)
    if end <= num_computed:
        return None
    targets = token_ids[num_computed + 1 : end + 1]
    return PromptLogprobsJob(req_id, flat_start, targets, num_computed + 1, num_logprobs)


def compute_prompt_logprobs(
    hidden: torch.Tensor, jobs: Sequence[PromptLogprobsJob], compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, LogprobsArrays]:
    """Run each job over the step's hidden states [T, H], ``PROMPT_LOGITS_SLICE`` positions at a time. The rows
    are always the log-softmax of the logits, whatever ``logprobs_mode`` (vLLM's ``_get_prompt_logprobs_dict``)."""
    out: dict[str, LogprobsArrays] = {}
    for job in jobs:
        pieces = []
        for begin in range(0, len(job.target_token_ids), PROMPT_LOGITS_SLICE):
            end = min(begin + PROMPT_LOGITS_SLICE, len(job.target_token_ids))
            states = hidden[job.flat_start + begin : job.flat_start + end]
            logits = compute_logits(states)
            logprobs = logits.log_softmax(dim=-1)
            targets = torch.tensor(job.target_token_ids[begin:end], dtype=torch.int64, device=logprobs.device)
            pieces.append([t.cpu().numpy() for t in token_logprobs(logprobs, targets, job.num_logprobs)])
        ids, values, ranks = (np.concatenate([p[k] for p in pieces]) for k in range(3))
        out[job.req_id] = pack_logprobs(ids, values, ranks, start=job.start)
    return out
