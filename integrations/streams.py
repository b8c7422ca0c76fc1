"""Framework-agnostic helpers over `RequestStream`s: first deltas, merging, disconnects.

Each stream has at most one pending ``__anext__`` at a time, so a slow client
lets the engine's collector merge deltas (memory stays bounded) instead of a
queue growing here. Leaving early in any way cancels the pending steps and
closes every stream, which aborts their requests in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from asyncllm.engine.stream import RequestStream
    from asyncllm.outputs import StreamDelta

__all__ = ["ClientDisconnected", "first_deltas", "merge_streams", "gather_until"]

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


async def first_deltas(streams: Sequence[RequestStream], *,
                       until: Callable[[], Awaitable[object]] | None = None) -> list[StreamDelta]:
    """Submit every stream at once and wait for each one's first delta.

    A server calls this before it sends a status line, so that an error raised
    at submission (a prompt longer than max_model_len, an overloaded engine)
    becomes a 400 or a 429 rather than an error event inside a 200 stream.
    `until` is `merge_streams`' disconnect watch: a client that leaves while its
    requests wait (queued behind a full engine) aborts them, `ClientDisconnected`.
    """
    steps = [asyncio.ensure_future(stream.__anext__()) for stream in streams]
    try:
        return await gather_until(steps, until)
    except BaseException:
        await _leave(steps, streams)
        raise


async def merge_streams(streams: Sequence[RequestStream], firsts: Sequence[StreamDelta] = (), *,
                        until: Callable[[], Awaitable[object]] | None = None,
                        held: Sequence[tuple[int, StreamDelta]] = (),
                        ) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Yield ``(stream index, delta)`` from all streams as deltas arrive, after `firsts` (from `first_deltas`) and
    `held` (``(stream index, delta)`` taken from the streams after their firsts, in order).

    `until` returns an awaitable that completes when the client disconnects:
    then every request is aborted and `ClientDisconnected` is raised.
    """
    for index, delta in [*enumerate(firsts), *held]:
        yield index, delta
    pending = {asyncio.ensure_future(stream.__anext__()): i for i, stream in enumerate(streams)}
    watcher = asyncio.ensure_future(until()) if until is not None else None
    try:
        while pending:
            waiting = set(pending) if watcher is None else {*pending, watcher}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if watcher is not None and watcher in done:
                raise ClientDisconnected()
            for step in sorted(done, key=pending.__getitem__):
                index = pending.pop(step)
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[index].__anext__())] = index
                yield index, delta
    finally:
        if watcher is not None:
            watcher.cancel()
        await _leave(list(pending), streams)


async def _leave(steps: list[asyncio.Future], streams: Sequence[RequestStream]) -> None:
    for step in steps:
        step.cancel()
    for stream in streams:
        await stream.aclose()


async def gather_until(awaitables: Sequence[Awaitable[T]], until: Callable[[], Awaitable[object]] | None = None) -> list[T]:
    """Run every awaitable at once, results in order (whole-response requests: embeddings, scores).

    The first error cancels the others (each cancelled engine call aborts its
    request) and is raised; `until` completing (the client went away) does the
    same and raises `ClientDisconnected`.
    """
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    watcher = asyncio.ensure_future(until()) if until is not None else None
    try:
        pending = set(tasks)
        while pending:
            done, _ = await asyncio.wait(pending if watcher is None else {*pending, watcher},
                                         return_when=asyncio.FIRST_COMPLETED)
            if watcher is not None and watcher in done:
                raise ClientDisconnected()
            for task in sorted(done, key=tasks.index):  # the first input's error when several fail at once
                task.result()
            pending -= done
        return [task.result() for task in tasks]
    finally:
        for future in [*tasks, *([watcher] if watcher is not None else [])]:
            future.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
