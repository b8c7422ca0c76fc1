"""`AsyncEngine.reset_prefix_cache` (vLLM's): later requests hit nothing computed before; running ones go on."""

from __future__ import annotations

import pytest

from asyncllm import AsyncEngine, BeamSearchParams, InvalidRequestError, SamplingParams
from asyncllm.integrations.sync import SyncEngine

PROMPT = list(range(3, 67))  # 64 tokens: 4 blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


async def _hits(engine: AsyncEngine, prompt: list[int] = PROMPT) -> tuple[int, list[int]]:
    before = engine.stats().prefix_cache_hits
    out = await engine.generate(prompt, GREEDY)
    return engine.stats().prefix_cache_hits - before, out.token_ids


async def test_a_reset_forgets_cached_blocks_and_running_requests_keep_theirs(tiny_llama: str) -> None:
    async with AsyncEngine(tiny_llama, disable_log_stats=True) as engine:
        first_hits, tokens = await _hits(engine)
        assert first_hits == 0
        assert await _hits(engine) == (48, tokens)  # 3 full blocks (the last token is always recomputed)
        assert await engine.reset_prefix_cache() is True
        assert await _hits(engine) == (0, tokens)
        assert await _hits(engine) == (48, tokens)
        # a reset while a request decodes: it keeps its KV and its tokens
        long = SamplingParams(temperature=0.0, max_tokens=40)
        expected = (await engine.generate(PROMPT[::-1], long)).token_ids
        await engine.reset_prefix_cache()
        stream = engine.stream(PROMPT[::-1], long)
        got = []
        async for delta in stream:
            if not got:
                await engine.reset_prefix_cache()
            got += delta.token_ids
        assert got == expected
        assert engine.stats().num_used_blocks == 0
        assert await _hits(engine, PROMPT[::-1]) == (0, expected[:8])  # held across a reset: not cached when freed
        assert await _hits(engine, PROMPT[::-1]) == (48, expected[:8])


def test_the_sync_engine_resets_and_searches_beams_too(tiny_llama: str) -> None:
    with SyncEngine(tiny_llama, disable_log_stats=True) as engine:
        beams = engine.beam_search(PROMPT, BeamSearchParams(beam_width=2, max_tokens=3))
        assert len(beams.sequences) == 2 and all(len(s.tokens) == len(PROMPT) + 3 for s in beams.sequences)
        engine.generate(PROMPT, GREEDY)
        assert engine.reset_prefix_cache() is True
        before = engine.stats().prefix_cache_hits
        engine.generate(PROMPT, GREEDY)
        assert engine.stats().prefix_cache_hits == before
        with pytest.raises(InvalidRequestError, match="model_path"):  # the blocking update_weights (docs/weight-updates.md)
            engine.update_weights("/no/such/checkpoint")
        assert engine.stats().weights_version == 0
