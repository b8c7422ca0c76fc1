"""Stand-ins for `RequestStream` in web adapter tests: states the real engine reaches only under load."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


class StalledStream:
    """Hands out deltas of `texts`, then never another: a request queued behind a full engine (no `texts`) or
    preempted mid-generation. `waiting` is set once it stalls, `closed` once the caller leaves it."""

    num_samples = 1

    def acceptance(self) -> asyncio.Event:
        """Accepted at once, as a queued request is (its prompt tokenized and checked): `RequestStream.acceptance`."""
        accepted = asyncio.Event()
        accepted.set()
        return accepted

    def __init__(self, texts: tuple[str, ...] = ()) -> None:
        self.texts = list(texts)
        self.waiting, self.closed = asyncio.Event(), asyncio.Event()

    def __aiter__(self) -> StalledStream:
        return self

    async def __anext__(self) -> SimpleNamespace:
        if self.texts:
            return SimpleNamespace(text=self.texts.pop(0))
        self.waiting.set()
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.set()

    async def __aenter__(self) -> StalledStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.closed.set()
