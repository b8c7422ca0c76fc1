"""Framework-agnostic helpers over `RequestStream`s: first deltas, merging, disconnects.

Each stream has at most one pending ``__anext__`` at a time, so a slow client
lets the engine's collector merge deltas (memory stays bounded) instead of a
queue growing here. Leaving early in any way cancels the pending steps and
closes every stream, which aborts their requests in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from asyncllm.engine.stream import RequestStream
    from asyncllm.outputs import StreamDelta

__all__ = ["ClientDisconnected", "TEXT_STREAM_HEADERS", "first_deltas", "accepted_streams", "merge_streams",
           "gather_until", "check_one_sample", "check_not_aborted", "empty_body"]

T = TypeVar("T")
_UNCANCEL = hasattr(asyncio.Task, "uncancel")  # Python 3.11+; on 3.10 one stream is merged as several are


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


TEXT_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""A streamed text reply's headers (the web adapters'), as the OpenAI server's event streams': not cached, and not
buffered by a proxy (nginx) that would hold its chunks back until the end."""


async def empty_body() -> AsyncIterator[str]:
    """A text response's body sent for a HEAD request (the web adapters'): nothing."""
    return
    yield  # an async generator


def check_not_aborted(delta: StreamDelta) -> None:
    """`RequestAbortedError` for a delta that ends its sample as aborted (``AsyncEngine.abort`` from the host's
    code, or the engine's close at shutdown): a text stream has no finish reason to say so, and would end as if
    the text were complete."""
    if delta.finish_reason == "abort":
        from asyncllm.errors import RequestAbortedError

        raise RequestAbortedError("the request was aborted before it finished (AsyncEngine.abort, or the engine "
                                  "closing)")


def check_one_sample(stream: RequestStream) -> None:
    """A text response streams one completion: `InvalidRequestError` naming ``n`` for a stream of several samples,
    whose texts would interleave in it (the OpenAI server's choices keep them apart)."""
    if stream.num_samples != 1:
        from asyncllm.errors import InvalidRequestError

        raise InvalidRequestError("n", f"this endpoint streams one completion's text, so n must be 1, got "
                                       f"{stream.num_samples}")


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


async def accepted_streams(streams: Sequence[RequestStream], *,
                           until: Callable[[], Awaitable[object]] | None = None,
                           ) -> tuple[list[tuple[int, StreamDelta]], dict[int, asyncio.Future]]:
    """Submit every stream at once and wait until each request is accepted (`RequestStream.acceptance`) or has its
    first delta: the ``(stream index, delta)`` taken so far and the other streams' pending first steps, for
    `merge_streams`' `taken` and `steps`.

    As `first_deltas`, an error at submission or from the host's checks of any of them (a prompt longer than
    max_model_len, an overloaded engine) is raised here, before a server sends its status line; unlike it, a
    prompt queued behind a full engine (more prompts than max_num_seqs) delays no other prompt's tokens.
    """
    events = [stream.acceptance() for stream in streams]
    steps = [asyncio.ensure_future(stream.__anext__()) for stream in streams]
    try:
        await gather_until([_settled(step, event) for step, event in zip(steps, events)], until)
        taken = [(index, step.result()) for index, step in enumerate(steps) if step.done()]  # the first error
    except BaseException:
        await _leave(steps, streams)
        raise
    return taken, {index: step for index, step in enumerate(steps) if not step.done()}


async def _settled(step: asyncio.Future, accepted: asyncio.Event) -> None:
    """Return once `step` is done (a delta or an error) or its request was accepted."""
    waiter = asyncio.ensure_future(accepted.wait())
    try:
        await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def merge_streams(streams: Sequence[RequestStream], firsts: Sequence[StreamDelta] = (), *,
                  until: Callable[[], Awaitable[object]] | None = None,
                  held: Sequence[tuple[int, StreamDelta]] = (), steps: Mapping[int, asyncio.Future] | None = None,
                  ) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Yield ``(stream index, delta)`` from all streams as deltas arrive, after `firsts` (from `first_deltas`) and
    `held` (``(stream index, delta)`` taken from the streams after their firsts, in order); `steps`: streams'
    pending reads to take over (`accepted_streams`), the others read afresh.

    `until` returns an awaitable that completes when the client disconnects:
    then every request is aborted and `ClientDisconnected` is raised.
    """
    taken = [*enumerate(firsts), *held]
    if len(streams) == 1 and _UNCANCEL and not steps:
        return _merge_one(streams[0], taken, until)
    return _merge_many(streams, taken, until, steps or {})


async def _merge_one(stream: RequestStream, taken: list[tuple[int, StreamDelta]],
                     until: Callable[[], Awaitable[object]] | None) -> AsyncIterator[tuple[int, StreamDelta]]:
    """`merge_streams` of one stream (``n=1``, most requests), read in the caller's task: no task per delta. A
    disconnect while the read waits cancels that wait as ``asyncio.timeout`` does (the task's own cancellation,
    taken back with ``uncancel``: a cancellation from elsewhere still propagates) and raises `ClientDisconnected`;
    one while the caller works (between reads) is raised at the next read."""
    for item in taken:
        yield item
    reader: asyncio.Task | None = None
    """The task waiting in a read, if one is (each read's own: a generator may be advanced from several tasks)."""
    hung_up = False
    """Whether `hang_up` cancelled a read: only that cancellation becomes `ClientDisconnected`."""

    def hang_up(_watch: asyncio.Future) -> None:
        nonlocal hung_up
        if reader is not None:
            hung_up = True
            reader.cancel()

    watcher = asyncio.ensure_future(until()) if until is not None else None
    if watcher is not None:
        watcher.add_done_callback(hang_up)
    try:
        while watcher is None or not watcher.done():
            reader = task = asyncio.current_task()
            entry = task.cancelling() if task is not None else 0
            try:
                delta = await stream.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:  # ours alone (as asyncio.timeout: counted from the read's start)
                if hung_up and task is not None and task.uncancel() <= entry:
                    raise ClientDisconnected() from None
                raise
            finally:
                reader = None
            yield 0, delta
        raise ClientDisconnected()
    finally:
        if watcher is not None:
            watcher.cancel()
        await stream.aclose()


async def _merge_many(streams: Sequence[RequestStream], taken: list[tuple[int, StreamDelta]],
                      until: Callable[[], Awaitable[object]] | None,
                      steps: Mapping[int, asyncio.Future]) -> AsyncIterator[tuple[int, StreamDelta]]:
    pending: dict[asyncio.Future, int] = {}
    wake = _Wake(pending)
    for i, stream in enumerate(streams):
        step = steps.get(i)
        wake.watch(asyncio.ensure_future(stream.__anext__()) if step is None else step, i)
    watcher = asyncio.ensure_future(until()) if until is not None else None
    if watcher is not None:
        watcher.add_done_callback(wake.wake)
    try:
        for item in taken:
            yield item
        while pending:  # asyncio.wait(FIRST_COMPLETED) without its per-call callbacks and sets: one per delta
            await wake.until_done(watcher)
            if watcher is not None and watcher.done():
                raise ClientDisconnected()
            for step in sorted([step for step in pending if step.done()], key=pending.__getitem__):
                index = pending.pop(step)
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    continue
                wake.watch(asyncio.ensure_future(streams[index].__anext__()), index)
                yield index, delta
    finally:
        if watcher is not None:
            watcher.cancel()
        await _leave(list(pending), streams)


class _Wake:
    """`merge_streams`' wait for the first of its steps (or the disconnect watch) to finish: each future calls it
    once when done (`watch`), which wakes the waiting generator; it waits as ``asyncio.wait`` does, yielding to the
    loop once even when a step is done already (a done step's callbacks run then). A step's callback that runs after
    the generator took the step (both in one loop turn) wakes nothing: no empty wake-ups, no turn lost to them."""

    __slots__ = ("_waiter", "_pending")

    def __init__(self, pending: dict[asyncio.Future, int]) -> None:
        self._waiter: asyncio.Future | None = None
        self._pending = pending

    def __call__(self, step: asyncio.Future) -> None:
        if step in self._pending:  # else taken already
            self.wake()

    def wake(self, _future: asyncio.Future | None = None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def watch(self, step: asyncio.Future, index: int) -> None:
        self._pending[step] = index
        step.add_done_callback(self)

    async def until_done(self, watcher: asyncio.Future | None) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        if (watcher is not None and watcher.done()) or any(step.done() for step in self._pending):
            loop.call_soon(self.wake, waiter)
        try:
            await waiter
        finally:
            self._waiter = None


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
