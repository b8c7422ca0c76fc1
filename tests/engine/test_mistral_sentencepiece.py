"""tokenizer_mode="mistral" over Mistral's sentencepiece file (tokenizer.model.v3, Mistral 7B v0.3's kind): prompts and
chats as mistral_common encodes them, greedy equal to transformers', structured output over its byte-fallback
pieces (asyncllm/mistral_tokenizer.py)."""

from __future__ import annotations

import re

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, SamplingParams, StructuredOutputs
from hf_reference import hf_greedy
from mistral_utils import tekken_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [{"role": "user", "content": "Beautiful is better"}, {"role": "assistant", "content": "than ugly"},
        {"role": "user", "content": "Explicit\nis better?"}]


@pytest.fixture(scope="module")
def spm_model(tiny_llama: str, tmp_path_factory) -> str:
    return tekken_checkpoint(tiny_llama, str(tmp_path_factory.mktemp("spm")), sentencepiece=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(spm_model: str):
    async with AsyncEngine(spm_model, tokenizer_mode="mistral", disable_log_stats=True, max_model_len=512) as engine:
        yield engine


def _mistral_common(path: str):
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(f"{path}/tokenizer.model.v3")


async def test_prompts_and_chats_are_mistral_commons(engine: AsyncEngine, spm_model: str) -> None:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    tokenizer = _mistral_common(spm_model)
    prompt = "Beautiful is better than ugly.\n  Explicit"
    out = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out.prompt_token_ids == tokenizer.instruct_tokenizer.tokenizer.encode(prompt, bos=True, eos=False)
    assert out.token_ids == hf_greedy(spm_model, out.prompt_token_ids, 12)
    expected = tokenizer.encode_chat_completion(ChatCompletionRequest.from_openai(CHAT)).tokens
    assert expected[:2] == [1, 3]  # BOS, [INST]
    chat = [d async for d in engine.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
    assert [t for d in chat for t in d.token_ids] == hf_greedy(spm_model, expected, 6)


async def test_structured_output_reads_the_byte_fallback_pieces(engine: AsyncEngine) -> None:
    pattern = r"(Yes|No)\. [a-z]{2,6}!\n[A-Z]"
    out = await engine.generate("Is it?", SamplingParams(temperature=0.0, max_tokens=30,
                                                         structured=StructuredOutputs(regex=pattern)))
    assert re.fullmatch(pattern, out.text), out.text
    choice = StructuredOutputs(choice=[" better than", "\u00e9t\u00e9 \u2013 x"])
    out = await engine.generate("Which?", SamplingParams(temperature=0.0, max_tokens=20, structured=choice))
    assert out.text in choice.choice and out.finish_reason == "stop"
