"""Granite Speech end to end (asyncllm/models/granite_speech.py, docs/multimodal.md#granite-speech): greedy tokens
equal transformers' for an audio prompt with the checkpoint's own adapter (a `LoRARequest` of the model folder, as
transformers turns it on for audio), the same prompt on the base model and a text prompt, batched, the audio's
placeholders split across prefill chunks; again from the prefix cache."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from audio_utils import SAMPLING_RATE, make_audio
from granite_speech_utils import AUDIO, hf_granite_speech_greedy, make_tiny_granite_speech

from asyncllm import AsyncEngine, LoRARequest, SamplingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_granite_speech(tmp_path_factory.mktemp("granite_speech"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(release: str):
    engine = AsyncEngine(release, enable_lora=True, max_lora_rank=8, disable_log_stats=True,
                         max_num_batched_tokens=16, max_num_seqs=4, limit_mm_per_prompt={"audio": 1})
    await engine.start()
    yield engine
    await engine.aclose()


async def test_audio_with_its_adapter_and_without_and_text_equal_transformers_then_from_the_prefix_cache(
        engine, release):
    audio = make_audio(2.5, seed=1)  # 125 encoder rows: 7 attention blocks of 20, 9 projector windows
    speech = {"prompt": f"<|user|>{AUDIO} what did you hear?<|assistant|>",
              "multi_modal_data": {"audio": (audio, SAMPLING_RATE)}}
    text = "<|user|>say something<|assistant|>"
    adapter = LoRARequest("speech", 1, release)

    async def run() -> list:
        return await asyncio.gather(engine.generate(speech, GREEDY, lora_request=adapter),
                                    engine.generate(speech, GREEDY), engine.generate(text, GREEDY))

    outs = await run()
    expected = [hf_granite_speech_greedy(release, speech["prompt"], audio, 8),
                hf_granite_speech_greedy(release, speech["prompt"], audio, 8, adapter=False),
                hf_granite_speech_greedy(release, text, None, 8)]
    for out, (prompt_ids, tokens) in zip(outs, expected):
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == (prompt_ids, tokens)
    assert outs[0].prompt_token_ids.count(engine.tokenizer.convert_tokens_to_ids(AUDIO)) == 27 > 16
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the adapter matters
    hits = engine.stats().prefix_cache_hits
    again = await run()
    assert engine.stats().prefix_cache_hits - hits >= 2 * 32  # both audio prompts' two whole blocks
    assert [o.outputs[0].token_ids for o in again] == [tokens for _, tokens in expected]


async def test_an_audio_too_short_for_its_features_fails_its_request(engine):
    with pytest.raises(InvalidRequestError, match="too short"):
        await engine.generate({"prompt": f"{AUDIO} hi", "audios": [(make_audio(0.01, seed=2), SAMPLING_RATE)]},
                              GREEDY)
