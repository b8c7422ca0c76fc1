"""A step's integer inputs in one host buffer (pinned on CUDA) and its device mirror: one copy a step.

A step's input ids, positions, KV slots, request rows, query starts, sequence
lengths and logits rows are the *sections* of one int64 buffer, laid out by
the step's token and request counts (`StepLayout`); `StepStaging.to_device`
copies the words they take to the device in one non-blocking copy (six copies
before: each a host-side launch of several microseconds, which a batch-1
decode step of a small model is made of). The int32 sections (query starts,
sequence lengths) are int64 words viewed as int32.

Every section starts on a 16-byte boundary: Triton specializes a kernel on
whether each pointer is 16-byte aligned, so aligned sections keep every step
on the kernels that start-up compiled (an unaligned one would compile another
variant in the middle of a served step). A layout of ``T`` tokens and ``R``
requests has the same addresses every time, so the decode layout of a capture
size is what that size's CUDA graph reads (workers/cuda_graphs.py): no copy
into the graph's own buffers.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

__all__ = ["StepLayout", "StepStaging", "pad_decode", "padded_size"]

_SECTIONS = ("input_ids", "positions", "slot_mapping", "request_rows", "query_start_loc", "seq_lens")
_INT32 = frozenset({"query_start_loc", "seq_lens"})


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``num_reqs`` requests; None past the largest."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def pad_decode(host: dict[str, np.ndarray], num_reqs: int) -> None:
    """Fill the rows past a decode batch's ``num_reqs`` one-token requests, to its layout's size, with padding: each
    a request with an empty query (its query start repeats the last real one) and no context, whose token writes no
    KV (slot -1); its request row (0) and block-table row are never read. The paged-attention kernel returns at once
    for an empty query, so padding reads and writes no KV; its hidden states are garbage, dropped
    (workers/cuda_graphs.py)."""
    for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("request_rows", 0),
                        ("seq_lens", 0)):
        host[name][num_reqs:] = value
    host["query_start_loc"][num_reqs + 1 :] = num_reqs


def _words(num: int, int32: bool = False) -> int:
    """int64 words a section of ``num`` entries takes, rounded up to 16 bytes."""
    words = -(-num // 2) if int32 else num
    return words + (words & 1)


def _extents(num_tokens: int, num_reqs: int) -> dict[str, tuple[int, int]]:
    """Each section's (first word, entries) in a layout of ``num_tokens`` and ``num_reqs``; ``logits_indices`` last."""
    entries = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
               "request_rows": num_reqs, "query_start_loc": num_reqs + 1, "seq_lens": num_reqs}
    extents, start = {}, 0
    for name in _SECTIONS:
        extents[name] = (start, entries[name])
        start += _words(entries[name], name in _INT32)
    extents["logits_indices"] = (start, 0)  # the rest of the buffer (`StepLayout`); a step copies its rows
    return extents


class StepLayout:
    """The sections of a layout: host arrays (``host[name]``) and device tensors (``device[name]``) of the section's
    full length; ``logits_indices`` spans the rest of the buffer."""

    def __init__(self, staging: StepStaging, num_tokens: int, num_reqs: int) -> None:
        self.num_tokens, self.num_reqs = num_tokens, num_reqs
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, torch.Tensor] = {}
        extents = _extents(num_tokens, num_reqs)
        for name, (start, num) in extents.items():
            if name == "logits_indices":  # as many rows as the buffer has room for
                num = staging.capacity - start
            end = start + _words(num, name in _INT32)
            host, device = staging.host_np[start:end], staging.device[start:end]
            if name in _INT32:
                host, device = host.view(np.int32), device.view(torch.int32)
            self.host[name], self.device[name] = host[:num], device[:num]
        self.logits_start = extents["logits_indices"][0]
        self._prefix: tuple[tuple[int, int], dict[str, torch.Tensor]] = ((-1, -1), {})

    def views(self, num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        """The device sections cut to a step of ``num_tokens`` and ``num_reqs`` (at most the layout's: a padded
        decode step's real rows); the last counts' are reused (steady decoding cuts the same every step)."""
        if self._prefix[0] != (num_tokens, num_reqs):
            assert num_tokens <= self.num_tokens and num_reqs <= self.num_reqs, (num_tokens, num_reqs, self.num_tokens)
            counts = {"query_start_loc": num_reqs + 1, "seq_lens": num_reqs, "request_rows": num_reqs}
            self._prefix = ((num_tokens, num_reqs), {name: self.device[name][: counts.get(name, num_tokens)]
                                                     for name in _SECTIONS})
        return self._prefix[1]


class StepStaging:
    """One int64 host buffer (pinned on CUDA) and its device mirror, holding a step's `StepLayout`."""

    def __init__(self, max_tokens: int, max_reqs: int, device: torch.device) -> None:
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self.capacity = _extents(max_tokens, max_reqs)["logits_indices"][0] + _words(max(max_tokens, max_reqs))
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(self.capacity, dtype=torch.int64, pin_memory=on_cuda)
        self.host_np = self.host.numpy()
        self.device = torch.zeros(self.capacity, dtype=torch.int64, device=device) if on_cuda else self.host
        self._layouts: dict[tuple[int, int], StepLayout] = {}
        self._copy: tuple[int, torch.Tensor, torch.Tensor] = (-1, self.device, self.host)  # the last copy's views

    def layout(self, num_tokens: int, num_reqs: int) -> StepLayout:
        """The layout of ``num_tokens`` and ``num_reqs`` (kept: its sections have the same addresses every step)."""
        key = (num_tokens, num_reqs)
        layout = self._layouts.get(key)
        if layout is None:
            assert 0 < num_reqs <= self.max_reqs and num_tokens <= self.max_tokens, (key, self.max_tokens, self.max_reqs)
            if len(self._layouts) >= 4096:  # prefill steps come in many shapes: keep the table small
                self._layouts.clear()
            layout = self._layouts[key] = StepLayout(self, num_tokens, num_reqs)
        return layout

    def to_device(self, layout: StepLayout, num_logits_rows: int = 0) -> None:
        """Copy the layout's sections and the first ``num_logits_rows`` logits rows to the device (non-blocking;
        nothing to do on the CPU, where the device tensors are the host buffer)."""
        if self.device is self.host:
            return
        end = layout.logits_start + num_logits_rows
        if self._copy[0] != end:
            self._copy = (end, self.device[:end], self.host[:end])
        self._copy[1].copy_(self._copy[2], non_blocking=True)
