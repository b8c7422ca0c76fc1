"""`AsyncEngine.aclose(drain=True)` counts a request from its call's entry (asyncllm/engine/drain.py): a beam search
across the drain gets its next steps and finishes, a request still on its way to submission is waited for, and a
call begun during the drain is refused."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import AsyncEngine, BeamSearchParams, EngineDeadError, SamplingParams

KWARGS = dict(disable_log_stats=True, max_model_len=128, num_gpu_blocks_override=32)


async def test_a_drain_finishes_a_beam_search(tiny_llama: str) -> None:
    engine = AsyncEngine(tiny_llama, **KWARGS)
    await engine.start()
    try:
        steps = 0
        generate = engine.generate

        async def counted(*args, **kwargs):  # a beam search step
            nonlocal steps
            steps += 1
            return await generate(*args, **kwargs)

        engine.generate = counted
        beams = asyncio.create_task(engine.beam_search([5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True)))
        await asyncio.wait_for(_until(lambda: steps >= 2 or beams.done()), 10)  # its second step runs: more to come
        closing = asyncio.create_task(engine.aclose(drain=True, timeout=30))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="closing"):
            await generate([1, 2], SamplingParams(max_tokens=2))  # begun during the drain
        out = await asyncio.wait_for(beams, 30)
        await closing
        assert [seq.num_output_tokens for seq in out.sequences] == [12, 12]
    finally:
        await engine.aclose()


async def test_a_drain_waits_for_a_request_not_yet_submitted(tiny_llama: str) -> None:
    """Nothing else in flight: the request on its way alone holds the drain (a short timeout, which it fits in)."""
    engine = AsyncEngine(tiny_llama, **KWARGS)
    await engine.start()
    try:
        pick = engine._replicas.pick

        async def slow_pick(*args, **kwargs):  # a request on its way to submission when the drain begins
            await asyncio.sleep(0.3)
            return await pick(*args, **kwargs)

        engine._replicas.pick = slow_pick
        on_its_way = asyncio.create_task(engine.generate([9, 8], SamplingParams(max_tokens=4, ignore_eos=True)))
        await asyncio.sleep(0.05)
        await engine.aclose(drain=True, timeout=5)
        late = await asyncio.wait_for(on_its_way, 10)
        assert late.outputs[0].finish_reason == "length" and len(late.outputs[0].token_ids) == 4
    finally:
        await engine.aclose()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)
