"""Deferred sampled tokens: a step's inputs built before the previous step's tokens reach the host.

With `async_scheduling` the core sends step N+1 while the workers still run
step N. Without deferral a worker waits for step N's sampled ids to come
back to the host, appends them to its rows, and only then builds step N+1:
the GPU idles for that round trip plus the whole input build and launch.
With deferral (`ModelRunner.launch_step`) the worker does not wait:

1. Step N's sampled ids stay on the device; a copy to pinned host memory is
   queued with an event, and every sampling row gets `PENDING_TOKEN` in
   place of its token (`PendingTokens`).
2. Step N+1's inputs are built on the host as usual, the pending rows'
   positions holding `PENDING_TOKEN`; after the host-to-device copy one
   device op writes step N's ids into those positions (`TokenFeedback`), in
   stream order after step N's sampler. Step N+1 is launched.
3. Then the worker waits for step N's event, writes the real ids into the
   rows (`PendingTokens.resolve`) and sends step N's output.

The GPU never waits for the host in steady decoding. The tokens are the
same as without deferral: the ids are the ones the sampler produced, only
read from the device instead of the host. Steps that need a row's tokens
on the host (penalties, prompt logprobs, multimodal rows) resolve the
pending step first (`ModelRunner._needs_host_tokens`).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from asyncllm.protocol import SchedulerOutput
    from asyncllm.workers.input_types import StepInputs

__all__ = ["PENDING_TOKEN", "InFlightStep", "PendingTokens", "TokenFeedback"]

PENDING_TOKEN = -1
"""Stands for a token sampled on the device but not yet copied to the host (never a vocabulary id)."""


class PendingTokens:
    """One step's sampled ids on their way to the host, and the rows waiting for them."""

    def __init__(self, device_tokens: torch.Tensor, host_tokens: torch.Tensor, rows: list[list[int]],
                 event: torch.cuda.Event | None) -> None:
        self.device_tokens = device_tokens
        """[S] int64 on the device, in the step's sampling order."""
        self.host_tokens = host_tokens
        """The pinned host copy being filled (the device tensor itself on a CPU worker)."""
        self.rows = rows
        """The token lists of the sampling rows, in the same order; each ends with `PENDING_TOKEN`."""
        self.indices = [len(tokens) - 1 for tokens in rows]
        """Where each row's pending token sits."""
        self.event = event
        self.tokens: list[int] | None = None
        """The ids once resolved."""

    def done(self) -> bool:
        """Whether the ids have reached the host (no wait)."""
        return self.event is None or self.event.query()

    def resolve(self) -> list[int]:
        """Wait for the ids, write them into the rows; the ids in sampling order (again on a second call)."""
        if self.tokens is None:
            if self.event is not None:
                self.event.synchronize()
            self.tokens = self.host_tokens.tolist()
            for row, index, token in zip(self.rows, self.indices, self.tokens):
                row[index] = token  # a row dropped since keeps its list alive, unused
        return self.tokens


class TokenFeedback:
    """Writes the last launched step's device ids into the next step's input ids."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self._host = torch.zeros((2, max_num_reqs), dtype=torch.int64, pin_memory=on_cuda)
        self._dst = torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=on_cuda)
        self._src = torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=on_cuda)
        self._device = device
        self._events = (torch.cuda.Event(), torch.cuda.Event()) if on_cuda else None
        """One per host buffer, recorded again each time that buffer is: its last copy done (created on first use)."""
        self._flip = 0
        self.pending: PendingTokens | None = None
        """The last deferred step whose ids some row still lacks on the host."""

    def defer(self, device_tokens: torch.Tensor, rows: list[list[int]]) -> PendingTokens:
        """Queue the copy of ``device_tokens`` to the host and mark ``rows`` (one per id) pending."""
        num = device_tokens.shape[0]
        if self._events is not None:
            host = self._host[self._flip, :num]  # two buffers: this step's copy must not overwrite the last one's
            event = self._events[self._flip]
            self._flip ^= 1
            host.copy_(device_tokens, non_blocking=True)
            event.record()
        else:
            host, event = device_tokens, None
        for tokens in rows:
            tokens.append(PENDING_TOKEN)
        self.pending = PendingTokens(device_tokens, host, rows, event)
        return self.pending

    def resolve(self, pending: PendingTokens) -> list[int]:
        """Wait for ``pending``'s ids and write them into its rows; from then on inputs take them from the host."""
        tokens = pending.resolve()
        if self.pending is pending:
            self.pending = None
        return tokens

    def fill(self, input_ids_host: np.ndarray, input_ids: torch.Tensor, query_start_loc: np.ndarray,
             computed: np.ndarray, row_lists: list[list[int]]) -> None:
        """Write the pending ids into ``input_ids`` (device) where the host copy holds `PENDING_TOKEN`.

        ``row_lists[i]`` is scheduled request i's token list, its slice
        ``computed[i]:`` flattened at ``query_start_loc[i]``.
        """
        num_tokens = int(query_start_loc[-1])
        holes = (input_ids_host[:num_tokens] == PENDING_TOKEN).nonzero()[0]
        if not len(holes):
            return
        pending = self.pending
        assert pending is not None, "input ids hold pending tokens but no step is pending"
        rows = pending.rows
        if len(holes) == num_tokens == len(rows) == len(row_lists) and all(map(operator.is_, row_lists, rows)):
            input_ids.copy_(pending.device_tokens)  # steady decoding: the same requests in the same order
            return
        where = {id(tokens): i for i, tokens in enumerate(rows)}
        req_index = np.searchsorted(query_start_loc, holes, side="right") - 1
        src = []
        for hole, i in zip(holes.tolist(), req_index.tolist()):
            j = where.get(id(row_lists[i]))
            assert j is not None and pending.indices[j] == computed[i] + hole - query_start_loc[i], (hole, i)
            src.append(j)
        num = len(src)
        self._dst[:num] = torch.from_numpy(holes)
        self._src[:num] = torch.tensor(src, dtype=torch.int64)
        dst = self._dst[:num].to(self._device, non_blocking=True)
        src_ids = self._src[:num].to(self._device, non_blocking=True)
        input_ids.index_copy_(0, dst, pending.device_tokens.index_select(0, src_ids))


class InFlightStep:
    """A launched step whose sampled ids are still on their way to the host (`ModelRunner.launch_step`)."""

    __slots__ = ("sched_out", "inputs", "pending")

    def __init__(self, sched_out: SchedulerOutput, inputs: StepInputs, pending: PendingTokens) -> None:
        self.sched_out = sched_out
        self.inputs = inputs
        self.pending = pending

    def done(self) -> bool:
        """Whether `ModelRunner.finish_step` would return without waiting."""
        return self.pending.done()
