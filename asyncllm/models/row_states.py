"""Per-request recurrent states kept by worker row, for the layers that keep a state instead of a KV cache
(Gated DeltaNet: asyncllm/models/gated_deltanet.py; Mamba2: asyncllm/models/mamba2.py).

A request keeps one row in the worker for its whole life there (`AttentionMetadata.request_rows`), so a layer's
state tensors have one row per worker row, preallocated for ``max_num_seqs`` rows when the model is built (before
the KV cache is sized) and grown if rows ever outnumber them. A request whose context is empty at a step (its first
chunk, or its first after a recompute preemption) starts from zeros, so a reused row never leaks an earlier
request's state; one that resumes from a prefix-cache hit starts from the states saved at the hit's end
(`AttentionMetadata.state_loads`), and the states are saved where the core planned (`state_saves`,
asyncllm/kv/state_checkpoints.py). Also here: the causal depthwise convolution both layers run before their scan,
with its last ``K - 1`` inputs as state.

A step that is not all one-token decodes runs its prefill chunks request by request (`RowStates.spans`) and its
other requests a position at a time, as decode steps over all their rows at once (`RowStates.positions`). That is
how speculative decoding runs: a request whose step verifies k drafts runs its k + 1 tokens as k + 1 decode steps,
its states after the verified token and after each draft but the last kept in its row's k snapshots; once
verified, `rollback` puts back the one after its accepted drafts (the model runner calls it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import new_param

__all__ = ["DepthwiseConv", "RowStates", "StateRows", "StepRows", "causal_conv", "conv_step"]


@dataclass(frozen=True)
class StateRows:
    """How many states a state layer preallocates."""

    rows: int = 256
    """One per worker row (``max_num_seqs``)."""
    checkpoints: int = 0
    """Saved states for prefix caching (``mamba_checkpoint_slots``; 0 with prefix caching off)."""
    drafts: int = 0
    """Speculative decoding's ``num_speculative_tokens``: a row keeps that many snapshots while its drafts are
    verified (`RowStates.rollback`)."""


@dataclass(frozen=True)
class StepRows:
    """A step's requests as the state layers see them."""

    rows: torch.Tensor
    """[num_reqs] int64 on the device: each request's row."""
    row_list: list[int]
    starts: list[int]
    """Where each request's tokens start in the step (``query_start_loc``; one more entry at the end)."""
    saves: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Row -> (tokens of its chunk, checkpoint slot), by tokens: save the row's states after that many tokens."""
    drafts: dict[int, int] = field(default_factory=dict)
    """Row -> how many drafts its last tokens verify: the states after each of them are kept (snapshots)."""
    positions: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = field(default_factory=list)
    """Of a step that is not all one-token decodes: its decodes and drafted requests a position at a time, as
    (their rows, their tokens' indices in the step, which requests), on the device (`RowStates.positions`)."""

    @property
    def lengths(self) -> list[int]:
        return [end - start for start, end in zip(self.starts, self.starts[1:])]

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.lengths)

    def is_short(self, i: int) -> bool:
        """Whether request ``i`` runs as decode steps (`RowStates.positions`): one token, or a verified token and
        its drafts."""
        return self.starts[i + 1] - self.starts[i] == 1 or self.row_list[i] in self.drafts


class RowStates:
    """Named state tensors ``[rows, *shape]``; `begin` readies them for a step."""

    def __init__(self, rows: StateRows, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.tensors = {name: torch.zeros(rows.rows, *shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
        self.saved = {name: torch.zeros(rows.checkpoints, *shape, dtype=dtype)
                      for name, (shape, dtype) in shapes.items()}
        """The checkpoint slots: states saved at points of earlier requests (prefix caching)."""
        self.snapshots = {name: torch.zeros(rows.rows if rows.drafts else 0, rows.drafts, *shape, dtype=dtype)
                          for name, (shape, dtype) in shapes.items()}
        """Per row, the states after its verified token and after each of its drafts but the last (speculative
        decoding): `rollback` restores the one of the accepted drafts."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self.tensors[name] = value

    def begin(self, metadata: AttentionMetadata, device: torch.device) -> StepRows:
        """The step's rows: the tensors moved to ``device`` and grown to hold them, first-chunk rows zeroed, rows
        that resume from a prefix-cache hit loaded from their checkpoint slots (before any slot is saved into)."""
        rows, row_list = metadata.request_rows, metadata.request_rows_cpu
        if rows is None or row_list is None:
            raise RuntimeError("a layer with per-request states needs each request's worker row "
                               "(AttentionMetadata.request_rows)")
        saves: dict[int, list[tuple[int, int]]] = {}
        for row, num_tokens, slot in sorted(metadata.state_saves or ()):
            saves.setdefault(row, []).append((num_tokens, slot))
        step = StepRows(rows, row_list, metadata.query_start_loc_cpu, saves, dict(metadata.state_drafts or ()))
        if not step.decode_only:  # the same for every state layer of the step: built once, kept on the metadata
            if metadata.state_positions is None:
                metadata.state_positions = _position_plan(step, device)
            step = replace(step, positions=metadata.state_positions)
        self._fit(max(row_list, default=-1) + 1, device)
        fresh = [row for row, n, seq in zip(row_list, step.lengths, metadata.seq_lens_cpu) if n and seq == n]
        if fresh:
            for tensor in self.tensors.values():
                tensor[fresh] = 0
        for row, slot in metadata.state_loads or ():
            for name, tensor in self.tensors.items():
                tensor[row] = self.saved[name][slot]
        return step

    def spans(self, step: StepRows) -> Iterator[tuple[int, slice]]:
        """The prefill chunks of the step (the other requests: `positions`) as ``(row, span)``, cut where their
        states are saved: once the caller has run a span (and asks for the next), the row's states are saved into
        the slots planned at its end."""
        for i, (row, start, n) in enumerate(zip(step.row_list, step.starts, step.lengths)):
            if step.is_short(i):
                continue
            done = 0
            for num_tokens, slot in step.saves.get(row, ()):
                if num_tokens > done:
                    yield row, slice(start + done, start + num_tokens)
                    done = num_tokens
                self._save(row, slot)
            if done < n:
                yield row, slice(start + done, start + n)

    def positions(self, step: StepRows) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The step's one-token decodes and drafted requests (the others: `spans`), a position at a time, as a
        decode step over their rows: ``(rows, their tokens' indices in the step)`` for positions 0, 1, ...; once
        the caller has run a position (and asks for the next), the states after it are kept where planned (a
        drafted row's snapshots, prefix-cache saves)."""
        for j, (rows, index, active) in enumerate(step.positions):
            yield rows, index
            self._keep_after(step, active, j + 1)

    def _keep_after(self, step: StepRows, active: list[int], point: int) -> None:
        """The states of ``active`` requests after ``point`` tokens: drafted rows' snapshots, planned saves."""
        rows, columns = [], []
        for i in active:
            row, n = step.row_list[i], step.lengths[i]
            k = step.drafts.get(row, 0)
            if n - k <= point < n:  # after the verified token (point n - k) and each draft but the last
                rows.append(row)
                columns.append(point - (n - k))
            for num_tokens, slot in step.saves.get(row, ()):
                if num_tokens == point:
                    self._save(row, slot)
        if rows:
            for name, tensor in self.tensors.items():
                self.snapshots[name][rows, columns] = tensor[rows]

    def rollback(self, row: int, num_drafts: int, accepted: int) -> None:
        """A row whose step verified ``num_drafts`` drafts and accepted ``accepted``: its states as they were after
        them (all accepted: they are already)."""
        if accepted < num_drafts:
            for name, tensor in self.tensors.items():
                tensor[row] = self.snapshots[name][row, accepted]

    @property
    def snapshots_per_row(self) -> int:
        return next(iter(self.snapshots.values())).shape[1]

    def save_decoded(self, step: StepRows) -> None:
        """After a step where every request decoded one token: the saves planned at its end."""
        for row, saves in step.saves.items():
            for _, slot in saves:
                self._save(row, slot)

    def _save(self, row: int, slot: int) -> None:
        for name, tensor in self.tensors.items():
            self.saved[name][slot] = tensor[row]

    def _fit(self, num_rows: int, device: torch.device) -> None:
        for name, saved in self.saved.items():
            self.saved[name] = saved.to(device)
        for tensors in (self.tensors, self.snapshots) if self.snapshots_per_row else (self.tensors,):
            for name, tensor in tensors.items():
                tensors[name] = _grown(tensor.to(device), num_rows)


def _position_plan(step: StepRows, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """`StepRows.positions` of ``step``."""
    short = [i for i in range(len(step.row_list)) if step.is_short(i)]
    plan = []
    for j in range(max((step.lengths[i] for i in short), default=0)):
        active = [i for i in short if step.lengths[i] > j]
        plan.append((torch.tensor([step.row_list[i] for i in active], device=device),
                     torch.tensor([step.starts[i] + j for i in active], device=device), active))
    return plan


def _grown(tensor: torch.Tensor, num_rows: int) -> torch.Tensor:
    if num_rows <= tensor.shape[0]:
        return tensor
    grow = max(num_rows, 2 * tensor.shape[0]) - tensor.shape[0]
    return torch.cat([tensor, tensor.new_zeros(grow, *tensor.shape[1:])])


class DepthwiseConv(nn.Module):
    """A causal depthwise convolution's ``weight [C, 1, K]`` and optional ``bias [C]`` (transformers' ``Conv1d``)."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param(channels, 1, kernel, dtype=dtype)
        self.bias = new_param(channels, dtype=dtype) if bias else None


def causal_conv(x: torch.Tensor, state: torch.Tensor, conv: DepthwiseConv, silu: bool = True) -> torch.Tensor:
    """One request's ``x [T, C]`` through the depthwise causal convolution after its previous ``K - 1`` inputs
    ``state [C, K - 1]`` (replaced by the last ``K - 1`` now), then SiLU unless ``silu`` is off: ``[T, C]``."""
    weight = conv.weight[:, 0]
    extended = torch.cat([state, x.t().to(state.dtype)], dim=1)
    state.copy_(extended[:, extended.shape[1] - state.shape[1]:])
    out = F.conv1d(extended.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), conv.bias, groups=weight.shape[0])[0]
    return (F.silu(out) if silu else out).t().to(x.dtype)


def conv_step(x: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, conv: DepthwiseConv,
              silu: bool = True) -> torch.Tensor:
    """One token of each of N requests, ``x [N, C]``, through the convolution after their rows' states (updated):
    ``[N, C]``."""
    weight = conv.weight[:, 0]
    window = torch.cat([states[rows], x.unsqueeze(-1).to(states.dtype)], dim=-1)
    states[rows] = window[..., 1:]
    out = (window.to(weight.dtype) * weight).sum(-1)
    out = out if conv.bias is None else out + conv.bias
    return (F.silu(out) if silu else out).to(x.dtype)
