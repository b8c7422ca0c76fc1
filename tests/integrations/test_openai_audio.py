"""OpenAI's speech-to-text routes over a tiny Whisper (integrations/openai_audio.py): the transcript equals
transformers' greedy one for the uploaded file (an audio longer than the model hears cut into pieces transcribed in
order), as JSON, text or server-sent events; translation takes the translate task token; the openai client reads
them; bad uploads and unknown fields are 400s naming them, a file past max_audio_bytes a 413, and a model that does
not transcribe refuses."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import pytest_asyncio
from asgi_helpers import asgi_client, hang_up_on, sse_events
from stream_stubs import StalledStream
from audio_utils import SAMPLING_RATE, make_audio, wav_bytes
from whisper_utils import CHUNK_SECONDS, hf_whisper_greedy, make_tiny_whisper

from asyncllm import AsyncEngine
from asyncllm.integrations.openai_protocol import ServerLimits
from asyncllm.integrations.openai_server import create_app
from asyncllm.mm.audios import read_audio
from asyncllm.speech import split_audio

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory) -> str:
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_whisper):
    engine = AsyncEngine(tiny_whisper, disable_log_stats=True, max_model_len=MAX_MODEL_LEN)
    await engine.start()
    yield engine
    await engine.aclose()


def _expected(engine: AsyncEngine, path: str, wav: bytes, prompt: str) -> str:
    """transformers' transcript of the decoded file: each piece's greedy tokens (to EOS or max_model_len), decoded
    and joined in order."""
    waveform = read_audio(wav, "file", SAMPLING_RATE).waveform
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    texts = [engine.tokenizer.decode(hf_whisper_greedy(path, piece, ids, MAX_MODEL_LEN - len(ids)),
                                     skip_special_tokens=True)
             for piece in split_audio(waveform, SAMPLING_RATE, CHUNK_SECONDS)]
    return "".join(texts)


async def _post(engine: AsyncEngine, route: str, wav: bytes, limits: ServerLimits | None = None,
                **fields: str) -> httpx.Response:
    async with asgi_client(create_app(engine, manage_engine=False, limits=limits)) as client:
        return await client.post(f"/v1/audio/{route}", files={"file": ("audio.wav", wav, "audio/wav")}, data=fields)


async def test_transcriptions_equal_transformers_in_every_format(engine, tiny_whisper):
    wav = wav_bytes(make_audio(1.5, seed=1))
    expected = _expected(engine, tiny_whisper, wav, "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>")
    assert expected
    as_json = await _post(engine, "transcriptions", wav, model=tiny_whisper, language="en")
    assert as_json.status_code == 200, as_json.text
    assert as_json.json() == {"text": expected, "usage": {"type": "duration", "seconds": 2}}
    as_text = await _post(engine, "transcriptions", wav, response_format="text")
    assert as_text.text == expected and as_text.headers["content-type"].startswith("text/plain")
    streamed = await _post(engine, "transcriptions", wav, stream="true")
    events = sse_events(streamed.text)
    assert "".join(e["delta"] for e in events[:-1]) == expected == events[-1]["text"]  # OpenAI's events
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == expected  # vLLM's chunks
    assert {e["type"] for e in events} == {"transcript.text.delta", "transcript.text.done"}


async def test_a_stream_with_stream_include_usage_ends_with_vllm_usage_chunk(engine, tiny_whisper):
    wav = wav_bytes(make_audio(1.5, seed=1))
    prompt = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    waveform = read_audio(wav, "file", SAMPLING_RATE).waveform
    generated = sum(len(hf_whisper_greedy(tiny_whisper, piece, ids, MAX_MODEL_LEN - len(ids)))
                    for piece in split_audio(waveform, SAMPLING_RATE, CHUNK_SECONDS))
    streamed = await _post(engine, "transcriptions", wav, language="en", stream="true", stream_include_usage="true")
    *events, last = sse_events(streamed.text)
    assert events[-1]["type"] == "transcript.text.done"  # the usage chunk last before [DONE]
    assert last["choices"] == [] and last["object"] == "transcription.chunk" and last["usage"] == {
        "prompt_tokens": len(ids), "completion_tokens": generated, "total_tokens": len(ids) + generated}


async def test_a_stream_cut_by_max_completion_tokens_finishes_with_length(engine):
    streamed = await _post(engine, "transcriptions", wav_bytes(make_audio(1.0, seed=1)), stream="true",
                           max_completion_tokens="3")
    done = sse_events(streamed.text)[-1]
    assert done["type"] == "transcript.text.done" and done["choices"][0]["finish_reason"] == "length"  # as vLLM's


async def test_long_audio_is_cut_into_pieces_transcribed_in_order(engine, tiny_whisper):
    wav = wav_bytes(make_audio(2.5 * CHUNK_SECONDS, seed=4))
    pieces = split_audio(read_audio(wav, "file", SAMPLING_RATE).waveform, SAMPLING_RATE, CHUNK_SECONDS)
    assert len(pieces) == 3 and all(p.size <= CHUNK_SECONDS * SAMPLING_RATE for p in pieces)
    expected = _expected(engine, tiny_whisper, wav, "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>")
    response = await _post(engine, "transcriptions", wav)
    assert response.json()["text"] == expected
    streamed = sse_events((await _post(engine, "transcriptions", wav, stream="true")).text)
    assert streamed[-1]["text"] == expected


async def test_translations_take_the_translate_task_and_the_openai_client_reads_them(engine, tiny_whisper):
    import openai

    wav = wav_bytes(make_audio(1.0, seed=2))
    expected = _expected(engine, tiny_whisper, wav, "<|startoftranscript|><|fr|><|translate|><|notimestamps|>")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine, manage_engine=False)),
                             base_url="http://test/v1")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
    async with http:
        translated = await client.audio.translations.create(model=tiny_whisper, file=("a.wav", wav),
                                                            extra_body={"language": "fr"})
        transcribed = await client.audio.transcriptions.create(model=tiny_whisper, file=("a.wav", wav), language="fr")
    assert translated.text == expected
    assert transcribed.text == _expected(engine, tiny_whisper, wav,
                                         "<|startoftranscript|><|fr|><|transcribe|><|notimestamps|>")


async def test_the_request_log_names_the_task(engine, caplog):
    """vLLM's request log: one line per request, ``transcribe-ID`` / ``translate-ID`` (ID the X-Request-Id header,
    the streamed chunks' id too), its sampling params and the client's prompt ("" when none)."""
    import logging

    from asyncllm.integrations.openai_request_log import RequestLogger

    caplog.set_level(logging.DEBUG, logger="asyncllm.integrations.openai.requests")
    files = {"file": ("audio.wav", wav_bytes(make_audio(0.5, seed=3)), "audio/wav")}
    async with asgi_client(create_app(engine, manage_engine=False, request_logger=RequestLogger())) as client:
        streamed = await client.post("/v1/audio/transcriptions", files=files, data={"stream": "true"},
                                     headers={"X-Request-Id": "a"})
        await client.post("/v1/audio/translations", files=files)
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncllm.integrations.openai.requests"]
    assert lines[0] == "Request transcribe-a details: prompt: '', prompt_token_ids: None, prompt_embeds shape: None."
    assert lines[1].startswith("Received request transcribe-a: params: SamplingParams(") and len(lines) == 4
    assert lines[3].startswith("Received request translate-") and "temperature=0.0" in lines[3]
    assert {event["id"] for event in sse_events(streamed.text) if "id" in event} == {"transcribe-a"}


async def test_a_client_gone_while_queued_aborts_a_streamed_transcription(engine, monkeypatch):
    stream = StalledStream()  # queued behind a full engine: no first token
    monkeypatch.setattr(engine, "stream", lambda *args, **kwargs: stream)
    request = httpx.Request("POST", "http://test/v1/audio/transcriptions", data={"stream": "true"},
                            files={"file": ("audio.wav", wav_bytes(make_audio(0.5, seed=3)), "audio/wav")})
    sent = await asyncio.wait_for(hang_up_on(create_app(engine, manage_engine=False), request, stream.waiting.wait), 5)
    assert sent[0]["status"] == 499 and stream.closed.is_set()  # aborted before a first token, no 200


@pytest.mark.parametrize("fields, param", [
    (dict(response_format="srt"), "response_format"), (dict(language="xx"), "language"),
    (dict(temperature="warm"), "temperature"), (dict(colour="blue"), "colour"),
    (dict(prompt="earlier words"), "prompt"),  # the tiny tokenizer has no <|startofprev|>
    (dict(max_completion_tokens="0"), "max_completion_tokens"),  # SamplingParams' max_tokens, by the form's name
    (dict(**{"timestamp_granularities[]": "word"}), "timestamp_granularities"),
])
async def test_bad_fields_are_400s_naming_them(engine, fields, param):
    response = await _post(engine, "transcriptions", wav_bytes(make_audio(0.5, seed=3)), **fields)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


async def test_bad_uploads_are_refused(engine):
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        missing = await client.post("/v1/audio/transcriptions", data={"model": "x"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] in ("file", "body")
    garbage = await _post(engine, "transcriptions", b"not audio at all")
    assert garbage.status_code == 400 and garbage.json()["error"]["param"] == "file"
    big = await _post(engine, "transcriptions", wav_bytes(make_audio(1.0, seed=3)), ServerLimits(max_audio_bytes=1000))
    assert big.status_code == 413
    wav = wav_bytes(make_audio(0.5, seed=3))  # a file of exactly max_audio_bytes fits: the form's other bytes aside
    exact = await _post(engine, "transcriptions", wav, ServerLimits(max_audio_bytes=len(wav)), max_completion_tokens="1")
    assert exact.status_code == 200, exact.text
    over = await _post(engine, "transcriptions", wav, ServerLimits(max_audio_bytes=len(wav) - 1))
    assert over.status_code == 413 and "audio file is larger" in over.json()["error"]["message"]
    ok = await _post(engine, "transcriptions", wav_bytes(make_audio(0.5, seed=3)))
    assert ok.status_code == 200  # still serving


async def test_a_model_that_does_not_transcribe_refuses(tiny_llama):
    async with AsyncEngine(tiny_llama, disable_log_stats=True) as engine:
        response = await _post(engine, "transcriptions", wav_bytes(make_audio(0.5, seed=3)))
    assert response.status_code == 400 and "speech-to-text" in response.json()["error"]["message"]
