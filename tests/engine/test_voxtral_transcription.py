"""Voxtral's transcription with its Mistral tokenizer (asyncllm/speech.py's `MistralTranscription`): the prompt is
mistral_common's transcription request's, and prompt ids and greedy tokens equal transformers' own
``VoxtralProcessor.apply_transcription_request`` and model, with and without a language, for an audio of one window
and of two (the whole audio in one request); ``engine.transcribe`` and ``/v1/audio/transcriptions`` give their
text; what the request cannot say (a prompt text, translation, timestamps, a language that is not ISO-639-1) is
refused naming its field, and an audio past max_model_len is refused whole."""

from __future__ import annotations

import pytest
import pytest_asyncio
from asgi_helpers import asgi_client
from audio_utils import make_audio, wav_bytes
from mistral_utils import AUDIO_ID, BEGIN_AUDIO_ID
from mm_utils import hf_generate
from voxtral_utils import WINDOW_ROWS, make_tiny_voxtral

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams
from asyncllm.integrations.openai_server import create_app
from asyncllm.speech import MistralTranscription

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
MAX_MODEL_LEN = 2048
"""Five 30 s windows of placeholders (375 each) and the prompt's few tokens."""


@pytest.fixture(scope="module")
def tekken_voxtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_voxtral(tmp_path_factory.mktemp("voxtral_transcription"), tekken=True)


def hf_transcription_greedy(path: str, wav_path: str, language: str | None) -> tuple[list[int], list[int]]:
    """transformers' processor (mistral_common's transcription request, the feature extractor) and model: (prompt
    ids, greedy tokens)."""
    import torch
    from transformers import AutoProcessor, VoxtralForConditionalGeneration

    inputs = AutoProcessor.from_pretrained(path).apply_transcription_request(audio=wav_path, model_id=path,
                                                                             language=language)
    model = VoxtralForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return hf_generate(model, inputs, MAX_TOKENS)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tekken_voxtral: str):
    async with AsyncEngine(tekken_voxtral, disable_log_stats=True, max_num_batched_tokens=512,
                           max_model_len=MAX_MODEL_LEN) as engine:
        yield engine


def _waveform(engine: AsyncEngine, wav: bytes):
    """The file decoded as the engine decodes it (asyncllm/mm/audios.py)."""
    from asyncllm.mm.audios import read_audio

    return read_audio(wav, "audio", engine.speech_to_text.sampling_rate).waveform


@pytest.mark.parametrize(("seconds", "language"), [(1.3, None), (1.3, "fr"), (31.0, "en")],
                         ids=["no-language", "fr", "two-windows"])
async def test_transcription_equals_transformers_processor_and_model(engine, tekken_voxtral, tmp_path, seconds,
                                                                     language) -> None:
    wav = wav_bytes(make_audio(seconds, seed=3))
    (tmp_path / "a.wav").write_bytes(wav)
    prompt_ids, tokens = hf_transcription_greedy(tekken_voxtral, str(tmp_path / "a.wav"), language)
    speech = engine.speech_to_text
    assert isinstance(speech, MistralTranscription)
    requests = speech.requests(speech.prompt("transcribe", language, None), _waveform(engine, wav))
    assert len(requests) == 1  # the whole audio: the host fills one window's placeholders per 30 s
    out = await engine.generate(requests[0], GREEDY)
    assert out.prompt_token_ids == prompt_ids and out.outputs[0].token_ids == tokens
    assert prompt_ids.count(AUDIO_ID) == WINDOW_ROWS * (2 if seconds > 30 else 1)
    text = "".join([piece async for piece in engine.transcribe(wav, language=language, params=GREEDY)])
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


async def test_the_prompt_is_mistral_commons_with_one_audio_token(engine) -> None:
    speech = engine.speech_to_text
    tokenizer = engine.tokenizer
    lang = tokenizer.encode("lang:de", add_special_tokens=False)
    assert speech.prompt("transcribe", "de", None) == [1, 3, BEGIN_AUDIO_ID, AUDIO_ID, 4, *lang,
                                                       tokenizer.convert_tokens_to_ids("[TRANSCRIBE]")]


@pytest.mark.parametrize(("fields", "field"), [(dict(prompt="Spell it Voxtral"), "prompt"),
                                               (dict(task="translate"), "task"),
                                               (dict(language="zz"), "language")])
async def test_what_the_request_cannot_say_is_refused_by_name(engine, fields, field) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        _ = [piece async for piece in engine.transcribe(wav_bytes(make_audio(0.5, seed=4)), params=GREEDY, **fields)]
    assert raised.value.field == field
    with pytest.raises(InvalidRequestError) as raised:
        await engine.transcribe_segments(wav_bytes(make_audio(0.5, seed=4)), params=GREEDY)
    assert raised.value.field == "timestamps"


async def test_an_audio_past_max_model_len_is_refused(engine) -> None:
    """One request hears the whole audio (as vLLM's Voxtral): six windows' 2250 placeholders pass 2048."""
    long = wav_bytes(make_audio(151.0, seed=5))
    with pytest.raises(InvalidRequestError, match=f"maximum context length is {MAX_MODEL_LEN} tokens. However, "
                                                  "your request has 2255 input tokens"):
        _ = [piece async for piece in engine.transcribe(long, params=GREEDY)]


async def test_the_transcriptions_route_answers_and_refuses_by_name(engine) -> None:
    wav = wav_bytes(make_audio(1.3, seed=6))
    expected = "".join([piece async for piece in engine.transcribe(wav, language="en", params=GREEDY)])
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        async def post(route: str = "transcriptions", **fields: str):
            return await client.post(f"/v1/audio/{route}", files={"file": ("a.wav", wav, "audio/wav")},
                                     data={"max_completion_tokens": str(MAX_TOKENS), **fields})

        answer = await post(language="en", response_format="text")
        assert answer.status_code == 200 and answer.text == expected
        as_json = await post(language="en")
        assert as_json.json() == {"text": expected, "usage": {"type": "duration", "seconds": 2}}
        for route, fields, field in [("transcriptions", dict(prompt="hint"), "prompt"),
                                     ("translations", {}, "task"),
                                     ("transcriptions", dict(response_format="srt"), "response_format")]:
            refused = await post(route, **fields)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field
