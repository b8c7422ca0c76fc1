"""Per-request mailboxes on the host's event loop, and the stream object.

A `RequestCollector` holds at most one pending `StreamDelta`: when the consumer
is slower than the engine, new deltas are merged into it, so memory stays
bounded and the processor thread never waits for a client.
"""

from __future__ import annotations

import asyncio

from asyncllm.outputs import RequestMetrics, StreamDelta


class RequestCollector:
    """Single-slot mailbox; `put*` and `get` run on the event loop thread."""

    def __init__(self, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.finished = False
        self._pending: StreamDelta | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, delta: StreamDelta) -> None:
        if self.finished:
            return
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.text += delta.text
            self._pending.token_ids.extend(delta.token_ids)
            self._pending.finish_reason = delta.finish_reason
            self._pending.stop_reason = delta.stop_reason
        if delta.finish_reason is not None:
            self.finished = True
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        if self.finished:
            return
        self.finished = True
        self._error = error
        self._ready.set()

    async def get(self) -> StreamDelta:
        """The merged delta since the last call; raises the request's error."""
        await self._ready.wait()
        self._ready.clear()
        delta, self._pending = self._pending, None
        if delta is not None:
            if self._error is not None:
                self._ready.set()
            return delta
        assert self._error is not None
        raise self._error
