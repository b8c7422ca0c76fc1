"""Voxtral as Mistral ships it, a tekken.json with an audio section and no transformers tokenizer: its chats encoded
by mistral_common (tokenizer_mode auto picks it), prompt ids and greedy tokens equal transformers' own
``VoxtralProcessor`` (which reads the same tekken.json through mistral_common) and model (docs/tokenizers.md)."""

from __future__ import annotations

import base64

import pytest
import pytest_asyncio
from audio_utils import make_audio, wav_bytes
from mistral_utils import AUDIO_ID, BEGIN_AUDIO_ID
from voxtral_utils import make_tiny_voxtral

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def tekken_voxtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_voxtral(tmp_path_factory.mktemp("voxtral_tekken"), tekken=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tekken_voxtral: str):
    async with AsyncEngine(tekken_voxtral, disable_log_stats=True, max_num_batched_tokens=256,
                           limit_mm_per_prompt={"audio": 2}, max_model_len=2048) as engine:
        yield engine


def _wav(seconds: float, seed: int) -> str:
    return base64.b64encode(wav_bytes(make_audio(seconds, seed=seed))).decode()


def hf_chat_greedy(path: str, messages: list[dict], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' processor (mistral_common's chat encoding, the feature extractor) and model: (prompt ids,
    greedy tokens); audio parts given as {"type": "audio", "base64": wav}."""
    import torch
    from transformers import AutoProcessor, VoxtralForConditionalGeneration

    inputs = AutoProcessor.from_pretrained(path).apply_chat_template(messages)
    model = VoxtralForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def _chats(audios: list[str]) -> tuple[list[dict], list[dict]]:
    """One conversation, as OpenAI's input_audio parts (ours) and as transformers' audio parts (its processor's)."""
    def user(parts):
        return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]

    return (user([{"type": "input_audio", "input_audio": {"data": a, "format": "wav"}} for a in audios]),
            user([{"type": "audio", "base64": a} for a in audios]))


@pytest.mark.parametrize("audios", [[(1.3, 1)], [(31.0, 2), (0.6, 3)]], ids=["one", "two-windows-and-one"])
async def test_chat_with_audio_equals_transformers_processor_and_model(engine, tekken_voxtral, audios) -> None:
    ours, theirs = _chats([_wav(seconds, seed) for seconds, seed in audios])
    prompt_ids, tokens = hf_chat_greedy(tekken_voxtral, theirs, 8)
    stream = engine.chat(ours, GREEDY)
    deltas = [d async for d in stream]
    assert stream.collector.prompt_token_ids == prompt_ids and [t for d in deltas for t in d.token_ids] == tokens


async def test_media_mistral_common_does_not_take_are_refused(engine) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(InvalidRequestError):
        _ = [d async for d in engine.chat([{"role": "user", "content": [image]}], GREEDY)]
    ours, _ = _chats([_wav(0.5, 4)])
    with pytest.raises(InvalidRequestError) as raised:
        _ = [d async for d in engine.chat(ours, GREEDY, chat_template_content_format="string")]
    assert raised.value.field == "chat_template_content_format"
    assert len([d async for d in engine.chat(ours, GREEDY)]) > 0


async def test_a_text_prompt_cannot_spell_the_audio_token_and_ids_can(engine) -> None:
    audio = {"audios": [(make_audio(1.0, seed=5), 16_000)]}
    with pytest.raises(InvalidRequestError, match="reads no control token from a text prompt"):
        await engine.generate({"prompt": "[BEGIN_AUDIO][AUDIO] what", **audio}, GREEDY)
    out = await engine.generate({"prompt_token_ids": [1, 3, BEGIN_AUDIO_ID, AUDIO_ID, 4], **audio}, GREEDY)
    assert out.prompt_token_ids.count(AUDIO_ID) == 375


async def test_mistral_commons_own_prompt_ids_with_audio_rows_are_served(engine, tekken_voxtral) -> None:
    """vLLM's offline Voxtral prompts: mistral_common's encoding (each audio's ``[AUDIO]`` run written out) as
    prompt_token_ids beside the audio, served as the chat is."""
    from audio_utils import SAMPLING_RATE

    waveform = make_audio(1.3, seed=7)
    ours, theirs = _chats([base64.b64encode(wav_bytes(waveform)).decode()])
    prompt_ids, tokens = hf_chat_greedy(tekken_voxtral, theirs, 8)
    assert prompt_ids.count(AUDIO_ID) > 1
    out = await engine.generate({"prompt_token_ids": prompt_ids, "audios": [(waveform, SAMPLING_RATE)]}, GREEDY)
    assert out.prompt_token_ids == prompt_ids and out.outputs[0].token_ids == tokens
