"""Granite, OLMo 2, Phi, OPT, GPTBigCode and MiniCPM3 through the whole engine: greedy output equals transformers',
token for token.

One engine per family on its tiny checkpoint (asyncllm.tiny "granite": every multiplier far from 1, tied
embeddings; "olmo2": post-sublayer norms, q/k norms over the whole projections; "phi": parallel layers with
LayerNorms, a partial rotary, a biased LM head; "opt": learned positions; "gpt_bigcode", StarCoder's: one KV head,
learned positions, its config's GPT-2 names that the workers read through transformers' aliases; "minicpm3":
latent attention over the latent cache, a half-split LongRoPE, muP's scalars far from 1), 16-token
chunked prefill and a
prefix-cache hit; sampled and prompt logprobs equal transformers' log-softmax (Granite's logits divided by
``logits_scaling``, MiniCPM3's final hidden states, on every path).
Logits per position and the tensor-parallel split of these and the other families of docs/granite-olmo2.md
(OLMo 3, SmolLM3, GLM, ...): tests/unit/test_granite_olmo2_models.py.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
import torch
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint
from hf_reference import hf_logits

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOGPROBS_ATOL = 1e-4


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["granite", "olmo2", "phi", "opt",
                                                                                 "gpt_bigcode", "minicpm3"])
async def served(request: pytest.FixtureRequest):
    path = tiny_checkpoint(request.param)
    async with AsyncEngine(path, max_model_len=64, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        yield engine, path


async def test_greedy_equals_transformers(served: tuple[AsyncEngine, str]) -> None:
    engine, path = served
    await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=5)


async def test_logprobs_equal_transformers_log_softmax(served: tuple[AsyncEngine, str]) -> None:
    engine, path = served
    prompt = list(range(40, 59))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = await engine.generate(prompt, params)
    tokens = prompt + out.token_ids
    expected = hf_logits(path, tokens[:-1]).log_softmax(-1)
    expected = expected.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
    prompt_got = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
    sampled_got = [entry[token].logprob for entry, token in zip(out.outputs[0].logprobs, out.token_ids)]
    assert prompt_got + sampled_got == pytest.approx(expected, abs=LOGPROBS_ATOL)
