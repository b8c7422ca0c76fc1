"""gpt-oss through the whole engine: greedy output equals transformers', token for token.

One engine on the tiny gpt-oss (asyncllm.tiny "gpt_oss": attention sinks, an 8-token window on every other layer,
YaRN, 4 biased experts with the clamped SwiGLU) with 16-token chunked prefill and a prefix-cache hit, and a LoRA
adapter on its attention (PEFT's tokens). Logits per
position, the experts' tensor-parallel splits and MXFP4 checkpoints: tests/unit/test_gpt_oss_models.py; two
tensor-parallel ranks: tests/unit/test_tp_layers.py.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers

from lora_utils import make_adapter, peft_greedy

from asyncllm import AsyncEngine, LoRARequest, SamplingParams
from asyncllm.tiny import tiny_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def path() -> str:
    return tiny_checkpoint("gpt_oss")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(path: str):
    async with AsyncEngine(path, max_num_batched_tokens=16, disable_log_stats=True, enable_lora=True,
                           max_lora_rank=8) as engine:
        yield engine


async def test_gpt_oss_greedy_equals_transformers(engine: AsyncEngine, path: str) -> None:
    await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=5)


async def test_an_adapter_on_its_attention_gives_peft_s_tokens(engine: AsyncEngine, path: str, tmp_path) -> None:
    adapter = make_adapter(path, str(tmp_path / "attn"), seed=3, rank=4, alpha=4,
                           targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    prompt = list(range(20, 40))
    out = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                lora_request=LoRARequest("attn", 1, adapter))
    assert out.token_ids == peft_greedy(path, adapter, prompt, 12)
