"""Per-request mailboxes on the host's event loop.

A `RequestCollector` holds at most one pending `StreamDelta` per sample: when
the consumer is slower than the engine, new deltas of a sample are merged
into its pending one, so memory stays bounded (n deltas) and the processor
thread never waits for a client. With ``output_kind`` CUMULATIVE or
FINAL_ONLY it accumulates each sample's whole output instead and hands out a
snapshot of it: after every change (CUMULATIVE) or once, when the sample
finishes (FINAL_ONLY).
"""

from __future__ import annotations

import asyncio

from asyncllm.engine.admission import Admitted
from asyncllm.outputs import PromptLogprobs, RequestMetrics, StreamDelta
from asyncllm.sampling import RequestOutputKind

__all__ = ["ACCEPTED", "Accepted", "RequestCollector", "StreamPacer", "merge_delta"]


class Accepted:
    """The processor thread's word that it accepted a request (tokenized and checked it, sent it to the core):
    delivered (`ACCEPTED`) only to a collector that waits for it (`RequestCollector.accepted`)."""


ACCEPTED = Accepted()


class _SampleOutput:
    """The whole output of one sample so far (CUMULATIVE / FINAL_ONLY)."""

    __slots__ = ("index", "chunks", "token_ids", "logprobs", "finish_reason", "stop_reason", "prompt_logprobs",
                 "cumulative_logprob")

    def __init__(self, index: int) -> None:
        self.index = index
        self.chunks: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.cumulative_logprob: float | None = None

    def add(self, delta: StreamDelta) -> None:
        self.chunks.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.cumulative_logprob = delta.cumulative_logprob
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def snapshot(self) -> StreamDelta:
        """A delta holding everything so far (its lists are copies the consumer may keep)."""
        text = "".join(self.chunks)
        self.chunks = [text]
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return StreamDelta(self.index, text, list(self.token_ids), self.finish_reason, self.stop_reason,
                           logprobs, self.prompt_logprobs, self.cumulative_logprob)


def merge_delta(into: StreamDelta, delta: StreamDelta) -> None:
    """Append `delta` (the same sample, later) to the pending `into`."""
    into.text += delta.text
    into.token_ids.extend(delta.token_ids)
    if delta.logprobs is not None:  # `into` came from the processor thread: its list is ours to extend
        if into.logprobs is None:
            into.logprobs = delta.logprobs
        else:
            into.logprobs.extend(delta.logprobs)
    into.finish_reason = delta.finish_reason
    into.stop_reason = delta.stop_reason
    into.cumulative_logprob = delta.cumulative_logprob  # a running total: the later one covers both
    if delta.prompt_logprobs is not None:
        into.prompt_logprobs = delta.prompt_logprobs


class StreamPacer:
    """One sample's deltas grouped by ``stream_interval`` tokens on the processor thread (its first delta and its
    last go at once)."""

    __slots__ = ("interval", "held", "delivered")

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.held: StreamDelta | None = None
        self.delivered = False

    def offer(self, delta: StreamDelta) -> StreamDelta | None:
        """`delta`, or the held tokens with it once they are `interval` many; None: held."""
        if self.held is not None:
            merge_delta(self.held, delta)
            delta, self.held = self.held, None
        if delta.finished or not self.delivered or len(delta.token_ids) >= self.interval:
            self.delivered = True
            return delta
        self.held = delta
        return None


class RequestCollector:
    """Mailbox of one request's `n` samples; `put*` and `get` run on the event loop thread.

    The processor thread sets `prompt_token_ids`, `num_cached_tokens`,
    `prompt_logprobs` and the `metrics` timestamps before the loop sees the
    deltas that depend on them.
    """

    def __init__(self, request_id: str, arrival_time: float, n: int = 1,
                 output_kind: RequestOutputKind = RequestOutputKind.DELTA, logprobs: bool = False,
                 admitted: Admitted | None = None, accepted: asyncio.Event | None = None) -> None:
        self.request_id = request_id
        self.accepted = accepted
        """Set once the processor thread accepted the request, or a delta or error came (`RequestStream.acceptance`);
        None: nobody waits for it, and the processor sends no word of it."""
        self.admitted = admitted
        """Its count in the host's queue estimate (admission and the data-parallel balancer;
        asyncllm/engine/admission.py), retracted if it fails."""
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: PromptLogprobs | None = None
        self.embedding: list[float] | None = None
        """An embedding request's embedding, set by the processor thread with the request's last delta."""
        self.num_cached_tokens = 0
        self.num_samples = n
        self.finished = False
        """Every sample finished, or the request failed: nothing more is accepted."""
        self.replica = 0
        """The data-parallel replica (engine core) that serves every sample of it (docs/parallelism.md)."""
        self._unfinished: dict[int, float | None] = dict.fromkeys(range(n), 0.0 if logprobs else None)
        """Each unfinished sample's latest ``cumulative_logprob``: what its abort delta carries (`abort`; with
        `logprobs` asked, 0.0 before its first token, as `_fail_all`'s)."""
        self._pending: dict[int, StreamDelta] = {}
        """DELTA: the merged pending delta of each sample, in arrival order."""
        self._samples = None if output_kind is RequestOutputKind.DELTA else [_SampleOutput(i) for i in range(n)]
        self._final_only = output_kind is RequestOutputKind.FINAL_ONLY
        self._changed: dict[int, None] = {}
        """CUMULATIVE / FINAL_ONLY: samples to snapshot, in order (an ordered set)."""
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    @property
    def done(self) -> bool:
        """Finished without error and everything handed out: the stream ends."""
        return self.finished and self._error is None and not self._pending and not self._changed

    def accept(self) -> None:
        if self.accepted is not None:
            self.accepted.set()

    def put(self, delta: StreamDelta) -> None:
        if self.finished:
            return
        if self.accepted is not None:
            self.accepted.set()
        if delta.finish_reason is not None:
            self._unfinished.pop(delta.index, None)
            self.finished = not self._unfinished
        elif delta.index in self._unfinished:
            self._unfinished[delta.index] = delta.cumulative_logprob
        if self._samples is None:
            pending = self._pending.get(delta.index)
            if pending is None:
                self._pending[delta.index] = delta
            else:
                merge_delta(pending, delta)
        else:
            self._samples[delta.index].add(delta)
            if not self._final_only or delta.finish_reason is not None:
                self._changed[delta.index] = None
            if not self._changed:
                return
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        if self.finished:
            return
        if self.admitted is not None:  # un-counted at once unless a snapshot came since it was admitted
            self.admitted.retract()
        self.finished = True
        self._error = error
        self._ready.set()
        self.accept()

    def abort(self) -> None:
        """End every unfinished sample with finish_reason "abort", as the engine's close does (`_fail_all`): the
        stream was left (`RequestStream.aclose`), and a task still reading it gets these last deltas."""
        for index, cumulative_logprob in list(self._unfinished.items()):
            self.put(StreamDelta(index, "", [], "abort", cumulative_logprob=cumulative_logprob))

    @property
    def pending(self) -> bool:
        """Deltas (or snapshots) not handed out yet."""
        return bool(self._pending or self._changed)

    async def get(self) -> StreamDelta:
        """The next sample's merged delta (or snapshot); raises the request's error once all are out."""
        await self._ready.wait()
        if self._pending:
            index = next(iter(self._pending))
            delta = self._pending.pop(index)
        elif self._changed:
            index = next(iter(self._changed))
            del self._changed[index]
            assert self._samples is not None
            delta = self._samples[index].snapshot()
        else:
            assert self._error is not None
            raise self._error
        if not self._pending and not self._changed and self._error is None:
            self._ready.clear()
        return delta
