"""The SSE path's per-token shortcuts keep their output: `ChunkEncoder` (meta encoded once) writes `sse_event`'s bytes,
and `merge_streams` (its own wait, not asyncio.wait per delta) keeps order, ends and disconnects."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm.integrations.openai_responses import sse_event
from asyncllm.integrations.openai_streaming import ChunkEncoder
from asyncllm.integrations.streams import ClientDisconnected, merge_streams

META = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "tiny"}
CHOICE = {"index": 1, "text": 'a "q"\n\u00e9\U0001f600', "logprobs": None, "finish_reason": None, "stop_reason": None}


@pytest.mark.parametrize("usage", [{}, {"usage": None}, {"usage": {"prompt_tokens": 3, "total_tokens": 5}},
                                   {"usage": None, "other": 1}, {"other": 2}])
@pytest.mark.parametrize("meta", [META, {}, {**META, "choices": "x"}, {**META, "usage": 1}])
def test_chunk_encoder_writes_sse_event_bytes(meta, usage):
    assert ChunkEncoder(meta)(CHOICE, usage) == sse_event({**meta, "choices": [CHOICE], **usage})


class _Stream:
    """Hands out `deltas`, each once its gate is set; `closed` once left."""

    def __init__(self, deltas):
        self.deltas = list(deltas)
        self.gates = [asyncio.Event() for _ in self.deltas]
        self.closed = False

    async def __anext__(self):
        if not self.deltas:
            raise StopAsyncIteration
        await self.gates[0].wait()
        self.gates.pop(0)
        return self.deltas.pop(0)

    async def aclose(self):
        self.closed = True


async def test_merge_streams_order_and_disconnect():
    a, b = _Stream(["a1", "a2", "a3"]), _Stream(["b1", "b2"])
    gone = asyncio.Event()
    merged = merge_streams([a, b], ["a0", "b0"], until=gone.wait)
    got = [await merged.__anext__() for _ in range(2)]
    b.gates[0].set()
    a.gates[0].set()  # both ready in one loop pass: stream order
    got += [await merged.__anext__() for _ in range(2)]
    b.gates[0].set()
    got.append(await merged.__anext__())
    a.gates[0].set()
    got.append(await merged.__anext__())  # b ended: only a's steps remain
    assert got == [(0, "a0"), (1, "b0"), (0, "a1"), (1, "b1"), (1, "b2"), (0, "a2")]
    gone.set()
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(merged.__anext__(), 10)
    assert a.closed and b.closed


async def test_merge_streams_ends_with_its_streams():
    a = _Stream(["x"])
    a.gates[0].set()
    assert [item async for item in merge_streams([a])] == [(0, "x")]
    assert a.closed


def test_merge_streams_alternates_a_ready_stream_with_one_a_loop_turn_behind():
    """A step taken in the loop turn its callback runs wakes nothing later: the merge stays as fair as asyncio.wait
    (a stale wake-up let the always-ready stream in twice as often)."""

    class Spinning:
        def __init__(self, name, turns):
            self.name, self.turns = name, turns

        async def __anext__(self):
            for _ in range(self.turns):
                await asyncio.sleep(0)
            return self.name

        async def aclose(self):
            pass

    async def first(count):
        names = []
        merged = merge_streams([Spinning("a", 0), Spinning("b", 1)])
        async for _, name in merged:
            names.append(name)
            if len(names) == count:
                break
        await merged.aclose()
        return names

    names = asyncio.run(first(100))
    assert 45 <= names.count("b") <= 55, names.count("b")


async def test_merge_streams_one_stream_disconnect():
    """One stream is read in the caller's task (no task per delta): a disconnect cancels the waiting read and raises
    `ClientDisconnected`, the stream closed with its later deltas untaken; a cancellation from elsewhere is not
    turned into a disconnect."""
    a = _Stream(["a1", "a2", "a3"])
    gone = asyncio.Event()
    merged = merge_streams([a], ["a0"], until=gone.wait)
    assert await merged.__anext__() == (0, "a0")
    a.gates[0].set()
    assert await merged.__anext__() == (0, "a1")
    waiting = asyncio.ensure_future(merged.__anext__())
    await asyncio.sleep(0.01)
    assert not waiting.done() and not a.closed
    gone.set()
    with pytest.raises(ClientDisconnected):
        await asyncio.wait_for(waiting, 10)
    assert a.closed and a.deltas == ["a2", "a3"]
    cancelled = _Stream(["c1"])
    merged = merge_streams([cancelled], until=asyncio.Event().wait)
    waiting = asyncio.ensure_future(merged.__anext__())
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cancelled.closed


async def test_merge_streams_one_stream_takes_back_only_its_own_cancellation():
    """As ``asyncio.timeout``: a cancellation from elsewhere in the disconnect's loop turn (a server's own
    disconnect handling, a TaskGroup) propagates, and a task already cancelling at the read still gets
    `ClientDisconnected` for the disconnect alone."""

    async def read(gone: asyncio.Event, cancels_before: int = 0) -> str:
        task = asyncio.current_task()
        for _ in range(cancels_before):  # a cancellation this task swallowed earlier, still counted
            task.cancel()
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                pass
        try:
            async for _ in merge_streams([_Stream(["x"])], until=gone.wait):
                pass
        except ClientDisconnected:
            return "disconnected"
        return "ended"

    gone = asyncio.Event()
    reader = asyncio.ensure_future(read(gone))
    await asyncio.sleep(0.01)
    gone.set()
    reader.cancel()  # the same loop turn: the watcher completes, its hang-up has not run
    with pytest.raises(asyncio.CancelledError):
        await reader
    gone = asyncio.Event()
    reader = asyncio.ensure_future(read(gone, cancels_before=1))
    await asyncio.sleep(0.01)
    gone.set()
    assert await asyncio.wait_for(reader, 10) == "disconnected"
