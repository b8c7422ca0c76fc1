"""`AsyncEngine.aclose(drain=True)`'s requests in flight: each from its public call's entry, not only once submitted.

A request counts from when it enters the engine's request path (`AsyncEngine._submit`, before its awaits: the start,
a replica's pick) until its collector is in flight, and a beam search (`EngineRequests.beam_search`) for the whole
search: between its steps nothing is submitted, and its next step's requests are taken while the engine drains. A
call begun once the drain began is refused (`EngineDeadError`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import anyio

from asyncllm.errors import EngineDeadError

__all__ = ["EngineDrain"]

_ACCEPTED: ContextVar["EngineDrain | None"] = ContextVar("asyncllm_accepted_request", default=None)
"""The drain whose beam search (or score) the running call is a step of (set by `EngineDrain.steps`; its step tasks
inherit it)."""


class EngineDrain:
    def __init__(self) -> None:
        self.draining = False
        self.entered = 0
        """Public calls open and not yet in flight as collectors (or beam searches and scores, for their whole run)."""

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """One request's call, counted while it runs; refused once the drain began, unless it is a step of a beam
        search or a score accepted before (run in its `steps` scope)."""
        if _ACCEPTED.get() is self:
            yield
            return
        if self.draining:
            raise EngineDeadError("the engine is closing (aclose(drain=True)); it takes no new requests")
        self.entered += 1
        try:
            yield
        finally:
            self.entered -= 1

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """A beam search's steps (a score's texts), inside its `request`: their requests (made here and in the tasks
        begun here) are taken while the engine drains."""
        token = _ACCEPTED.set(self)
        try:
            yield
        finally:
            _ACCEPTED.reset(token)

    async def wait(self, busy: Callable[[], bool], alive: Callable[[], bool], timeout: float | None) -> None:
        """Refuse new requests; return once no call is open and the submitted ones are not `busy` (or no core is
        `alive` to finish them, serving or being restarted), or after `timeout` seconds."""
        self.draining = True
        with anyio.move_on_after(timeout):
            while self.entered or busy():
                if not alive():
                    return  # nothing more will finish
                await asyncio.sleep(0.01)
