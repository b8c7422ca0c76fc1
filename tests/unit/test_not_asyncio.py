"""asyncllm runs on asyncio only: an `AsyncEngine` call where no asyncio loop runs (trio, anyio's trio backend)
raises `EventLoopError` saying so, not asyncio's bare "no running event loop"; nothing starts."""

from __future__ import annotations

import pytest

from asyncllm import AsyncEngine, EventLoopError, SamplingParams

CALLS = {
    "start": lambda engine: engine.start(),
    "generate": lambda engine: engine.generate("def", SamplingParams(max_tokens=4)),
    "stream": lambda engine: engine.stream("def", SamplingParams(max_tokens=4)).__anext__(),
    "aclose": lambda engine: engine.aclose(),
    "generate_many": lambda engine: engine.generate_many(["def"], SamplingParams(max_tokens=4)),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_with_no_asyncio_loop_running_says_asyncllm_runs_on_asyncio(call: str) -> None:
    engine = AsyncEngine()  # cheap: nothing starts before a call
    coro = CALLS[call](engine)
    try:
        with pytest.raises(EventLoopError, match="asyncllm runs on asyncio only.*task-runners.md"):
            coro.send(None)  # its first step, with no loop running: as a trio task runs it
    finally:
        coro.close()
    assert not engine.started


def test_under_anyio_with_the_trio_backend() -> None:
    pytest.importorskip("trio")
    import anyio

    engine = AsyncEngine()
    errors: list[BaseException] = []

    async def main() -> None:
        for call in CALLS.values():
            try:
                await call(engine)
            except BaseException as exc:  # noqa: BLE001 - the test checks each
                errors.append(exc)

    anyio.run(main, backend="trio")
    assert [type(e) for e in errors] == [EventLoopError] * len(CALLS)
    assert "trio" in str(errors[0]) and not engine.started
