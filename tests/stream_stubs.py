"""Stand-ins for `RequestStream` in web adapter tests: states the real engine reaches only under load."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncllm.errors import EngineDeadError, InvalidRequestError


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
            return SimpleNamespace(text=self.texts.pop(0), finish_reason=None)
        self.waiting.set()
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.set()

    async def __aenter__(self) -> StalledStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.closed.set()


class FailingStream(StalledStream):
    """Hands out deltas of `texts`, then ends as the engine breaks a request off after its first tokens: `end`
    raised (`EngineDeadError`, an error found late, a bug's exception), or ``"abort"``, a last delta with
    finish_reason "abort" (`AsyncEngine.abort`, the engine's close)."""

    def __init__(self, texts: tuple[str, ...], end: BaseException | str) -> None:
        super().__init__(texts)
        self.end = end

    async def __anext__(self) -> SimpleNamespace:
        if self.texts:
            return SimpleNamespace(text=self.texts.pop(0), finish_reason=None)
        if self.closed.is_set():
            raise StopAsyncIteration
        if self.end == "abort":
            self.closed.set()
            return SimpleNamespace(text="", finish_reason="abort")
        raise self.end


MID_STREAM_ENDS = {
    "engine-dead": (lambda: EngineDeadError("the engine core died"), "server_error", "engine_dead"),
    "late-invalid": (lambda: InvalidRequestError("structured_outputs", "late"), "invalid_request_error", None),
    "abort": (lambda: "abort", "server_error", "request_aborted"),
    "bug": (lambda: RuntimeError("a bug"), "server_error", None),
}
"""How a stream may end after its first bytes went out: (a `FailingStream` end's maker, its error body's type and
``code``)."""


def error_line_of(body: str, texts: tuple[str, ...]) -> dict:
    """The error body of a text stream's last line, after the `texts` streamed before the error."""
    import json

    prefix = "".join(texts) + "\n"
    assert body.startswith(prefix) and body.endswith("\n"), body
    return json.loads(body[len(prefix):])["error"]
