"""`engine.generate(prompt, sampling_params=...)` and `engine.stream(...)`: vLLM's name for the params argument
(asyncllm/engine/engine_requests.py)."""

from __future__ import annotations

import pytest

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.tiny import tiny_checkpoint


def test_sampling_params_is_vllms_name_for_params() -> None:
    engine = AsyncEngine(tiny_checkpoint())  # not started: the stream checks its arguments first
    params = SamplingParams(max_tokens=3)
    assert engine.stream("def f", sampling_params=params)._params is params
    with pytest.raises(InvalidRequestError, match="give one of them"):
        engine.stream("def f", params, sampling_params=params)


async def test_generate_runs_with_sampling_params() -> None:
    async with AsyncEngine(tiny_checkpoint(), disable_log_stats=True) as engine:
        out = await engine.generate("def f", sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
