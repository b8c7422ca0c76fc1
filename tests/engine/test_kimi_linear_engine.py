"""Kimi-Linear's engine refusals: LoRA and pipeline parallelism, by name. Its greedy tokens through the engine
(chunked, preempted, on reused rows, from saved states after prefix hits): tests/engine/test_hybrid_engine.py."""

from __future__ import annotations

import pytest

from asyncllm import AsyncEngine, NotBuiltError
from asyncllm.tiny import tiny_checkpoint


@pytest.mark.parametrize("fields, field", [({"enable_lora": True}, "enable_lora"),
                                           ({"pipeline_parallel_size": 2}, "pipeline_parallel_size")])
async def test_lora_and_pipeline_parallelism_are_refused(fields: dict, field: str) -> None:
    with pytest.raises(NotBuiltError, match="KimiLinearForCausalLM") as info:
        async with AsyncEngine(tiny_checkpoint("kimi_linear"), disable_log_stats=True, **fields):
            pass
    assert info.value.field == field
