"""gpt-oss through the whole engine: greedy output equals transformers', token for token.

One engine on the tiny gpt-oss (asyncllm.tiny "gpt_oss": attention sinks, an 8-token window on every other layer,
YaRN, 4 biased experts with the clamped SwiGLU) with 16-token chunked prefill and a prefix-cache hit. Logits per
position, the experts' tensor-parallel splits and MXFP4 checkpoints: tests/unit/test_gpt_oss_models.py; two
tensor-parallel ranks: tests/unit/test_tp_layers.py.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers

from asyncllm import AsyncEngine
from asyncllm.errors import NotBuiltError
from asyncllm.tiny import tiny_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def path() -> str:
    return tiny_checkpoint("gpt_oss")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(path: str):
    async with AsyncEngine(path, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        yield engine


async def test_gpt_oss_greedy_equals_transformers(engine: AsyncEngine, path: str) -> None:
    await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=5)


async def test_lora_on_gpt_oss_is_not_built(path: str) -> None:
    with pytest.raises(NotBuiltError, match="LoRA adapters for GptOssForCausalLM"):
        async with AsyncEngine(path, enable_lora=True):
            pass
