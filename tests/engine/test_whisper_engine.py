"""Whisper end to end (asyncllm/models/whisper.py, docs/multimodal.md#whisper): greedy transcripts equal
transformers' for audios batched together, the decoder prompt chunked, requests preempted (recomputed or swapped:
their cross-attention states computed again when they resume), prefix-cache hits (only for the same audio), over two
tensor-parallel ranks; a prompt without its audio fails alone. The checkpoint's generation_config.json suppresses
tokens and has timestamp tokens: greedy tokens equal transformers' ``generate`` with and without ``return_timestamps``
(workers/generation_rules.py), and ``AsyncEngine.transcribe_segments`` and the OpenAI routes' verbose_json, srt and
vtt give the segments of those tokens; word timestamps and the misuses are 400s."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from asgi_helpers import asgi_client
from audio_utils import SAMPLING_RATE, make_audio, wav_bytes
from whisper_utils import CHUNK_SECONDS, PROMPT, hf_whisper_generate, hf_whisper_greedy, make_tiny_whisper

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import RequestOutputKind
from asyncllm.integrations.openai_server import create_app
from asyncllm.mm.audios import read_audio
from asyncllm.speech_segments import srt, vtt

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 12
MAX_MODEL_LEN = 48
TIMED_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
TIMED = "<|startoftranscript|><|en|><|transcribe|>"
"""The prompt with timestamps (no <|notimestamps|>)."""


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory) -> str:
    return make_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny", timestamps=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_whisper):
    """One engine with the defaults (prefix caching on) for the tests that need nothing else."""
    async with AsyncEngine(tiny_whisper, disable_log_stats=True, max_model_len=MAX_MODEL_LEN) as engine:
        yield engine


def _request(prompt: str, audio) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"audio": (audio, SAMPLING_RATE)}}


def _prompt_ids(path: str, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(prompt, add_special_tokens=False).input_ids


async def _check(engine: AsyncEngine, path: str, prompts: list[str], audios: list) -> list:
    outs = await asyncio.gather(*(engine.generate(_request(p, a), GREEDY) for p, a in zip(prompts, audios)))
    for out, prompt, audio in zip(outs, prompts, audios):
        ids = _prompt_ids(path, prompt)
        assert out.prompt_token_ids == ids  # the decoder prompt as written: no BOS, no <|endoftext|>
        assert out.outputs[0].token_ids == hf_whisper_greedy(path, audio, ids, MAX_TOKENS)
    return outs


def _workload() -> tuple[list[str], list]:
    """Five requests: short and long decoder prompts (the long ones chunked), audios of 0.4 s to 3 s (cut at 2 s)."""
    prompts = [PROMPT, PROMPT + " hello there" * 12, PROMPT, PROMPT + " the rain in spain" * 8, PROMPT]
    return prompts, [make_audio(seconds, seed=i) for i, seconds in enumerate((1.5, 0.4, 3.0, 1.0, 2.0))]


@pytest.mark.parametrize("fields", [dict(), dict(num_gpu_blocks_override=10, max_model_len=96),
                                    dict(num_gpu_blocks_override=10, max_model_len=96, preemption_mode="swap",
                                         swap_space=0.01),
                                    dict(tensor_parallel_size=2)],
                         ids=["batched-chunked", "preempt-recompute", "preempt-swap", "tp2"])
async def test_transcripts_equal_transformers(tiny_whisper, fields: dict):
    prompts, audios = _workload()
    async with AsyncEngine(tiny_whisper, disable_log_stats=True, max_num_batched_tokens=32, **fields) as engine:
        await _check(engine, tiny_whisper, prompts, audios)
        stats = engine.stats()
    if "num_gpu_blocks_override" in fields:
        assert stats.num_preemptions_total > 0


async def test_prefix_hits_only_for_the_same_audio(engine, tiny_whisper):
    """The audio's hash joins every block's: the same long prompt with the same audio hits the cache (its cross
    states computed anyway), with another audio it does not; both transcripts equal transformers'."""
    prompt = PROMPT + " once upon a time" * 3  # two whole blocks of 16
    first, other = make_audio(1.2, seed=7), make_audio(1.2, seed=8)
    (cold,) = await _check(engine, tiny_whisper, [prompt], [first])
    (miss,) = await _check(engine, tiny_whisper, [prompt], [other])  # its row now holds the other audio's states
    (hit,) = await _check(engine, tiny_whisper, [prompt], [first])
    assert cold.num_cached_tokens == 0 and hit.num_cached_tokens >= 32 and miss.num_cached_tokens == 0


async def test_prompts_without_their_audio_fail_alone(engine, tiny_whisper):
    audio = make_audio(1.0, seed=1)
    with pytest.raises(InvalidRequestError, match="startoftranscript"):
        await engine.generate(PROMPT, GREEDY)  # no audio
    with pytest.raises(InvalidRequestError, match="placeholder"):
        await engine.generate(_request("<|en|><|transcribe|>", audio), GREEDY)  # no start token for it
    with pytest.raises(InvalidRequestError, match="2 audios"):
        await engine.generate({"prompt": PROMPT + PROMPT, "multi_modal_data": {"audio": [(audio, SAMPLING_RATE)] * 2}},
                              GREEDY)
    await _check(engine, tiny_whisper, [PROMPT], [audio])  # still serving


async def test_an_audio_of_a_shape_the_encoder_refuses_fails_alone(engine, tiny_whisper):
    """A host process sharing the core that sends log-mel frames of a shape the encoder cannot take: that request
    fails (its decoder never gets cross-attention states), the one beside it runs."""
    import msgspec
    from mm_utils import items_altered

    bad = {"data": bytes(4 * 20 * 10), "shape": [20, 10]}  # float32 [mels, frames], not the checkpoint's
    with items_altered(engine, lambda item: msgspec.structs.replace(item, **bad)):
        failed = engine.generate(_request(PROMPT, make_audio(1.0, seed=11)), GREEDY)
        with pytest.raises(InvalidRequestError, match=r"mm_items\[0\]: the encoder refused its data of shape \[20, 10"):
            await failed
    await _check(engine, tiny_whisper, [PROMPT], [make_audio(1.0, seed=12)])


async def test_prompts_given_as_embeddings_are_refused_at_start_as_a_speech_models(tiny_whisper):
    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import NotBuiltError

    with pytest.raises(NotBuiltError, match=r"WhisperForConditionalGeneration \(it takes audio\)") as info:
        prepare(EngineConfig.create(tiny_whisper, enable_prompt_embeds=True))
    assert "images" not in str(info.value) and info.value.field == "enable_prompt_embeds"


async def test_vllm_encoder_decoder_prompts(engine, tiny_whisper):
    """vLLM's explicit ``encoder_prompt`` (the audio) / ``decoder_prompt`` (text, ids or none: the start token
    alone) give the tokens of the one-prompt form; on a decoder-only model they are refused."""
    audio = make_audio(1.0, seed=5)
    ids = _prompt_ids(tiny_whisper, PROMPT)
    encoder = {"prompt": "", "multi_modal_data": {"audio": (audio, SAMPLING_RATE)}}
    (expected,) = await _check(engine, tiny_whisper, [PROMPT], [audio])
    for decoder in (PROMPT, {"prompt": PROMPT}, {"prompt_token_ids": ids}):
        out = await engine.generate({"encoder_prompt": encoder, "decoder_prompt": decoder}, GREEDY)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == expected.outputs[0].token_ids
    alone = await engine.generate({"encoder_prompt": encoder, "decoder_prompt": None}, GREEDY)
    assert alone.prompt_token_ids == ids[:1]
    assert alone.outputs[0].token_ids == hf_whisper_greedy(tiny_whisper, audio, ids[:1], MAX_TOKENS)
    with pytest.raises(InvalidRequestError, match="encoder takes the audio alone"):
        await engine.generate({"encoder_prompt": {**encoder, "prompt": "words"}, "decoder_prompt": PROMPT}, GREEDY)


async def test_engine_transcribe_joins_a_long_audios_pieces_in_order(engine, tiny_whisper):
    """``AsyncEngine.transcribe``: a 5 s audio (the tiny model hears 2 s) as pieces run at once, their texts in
    order, each equal to transformers' transcript of its piece; translation takes the translate task token."""
    from asyncllm.speech import split_audio

    audio = make_audio(2.5 * 2, seed=11)
    text = "".join([piece async for piece in engine.transcribe((audio, SAMPLING_RATE))])
    translated = "".join([piece async for piece in engine.transcribe(audio[:SAMPLING_RATE], task="translate",
                                                                    language="fr")])
    pieces = split_audio(audio, SAMPLING_RATE, 2.0)
    assert len(pieces) >= 3  # cut at quiet moments: a piece may end up to a second early

    def reference(piece, prompt: str) -> str:
        ids = _prompt_ids(tiny_whisper, prompt)
        tokens = hf_whisper_greedy(tiny_whisper, piece, ids, MAX_MODEL_LEN - len(ids))
        return engine.tokenizer.decode(tokens, skip_special_tokens=True)

    assert text == "".join(reference(piece, PROMPT) for piece in pieces)
    assert translated == reference(audio[:SAMPLING_RATE], "<|startoftranscript|><|fr|><|translate|><|notimestamps|>")


async def test_greedy_tokens_equal_transformers_generate(engine, tiny_whisper):
    """Two audios, with timestamps and without (12 tokens: transformers cuts its output at timestamp pairs even
    then), batched together; the timestamps come in pairs and the suppressed ids change the tokens."""
    audios = [make_audio(1.5, seed=seed) for seed in range(2)]
    jobs = [(audio, timed, 20 if timed else 12) for audio in audios for timed in (True, False)]
    outs = await asyncio.gather(*(engine.generate(_request(TIMED + ("" if timed else "<|notimestamps|>"), audio),
                                                  SamplingParams(temperature=0.0, max_tokens=n))
                                  for audio, timed, n in jobs))
    begin = engine.speech_to_text.timestamp_begin
    for out, (audio, timed, n) in zip(outs, jobs):
        assert out.outputs[0].token_ids == hf_whisper_generate(tiny_whisper, audio, n, timed)
    stamps = [[t for t in out.outputs[0].token_ids if t >= begin] for out, (_, timed, _) in zip(outs, jobs) if timed]
    assert all(len(s) >= 3 for s in stamps)
    prompt = engine.tokenizer(TIMED + "<|notimestamps|>", add_special_tokens=False).input_ids
    unconstrained = hf_whisper_greedy(tiny_whisper, audios[0], prompt, 12, suppress=False)
    assert unconstrained != outs[1].outputs[0].token_ids  # the checkpoint's suppress lists bite


async def test_segments_of_a_long_audio_and_the_routes(engine, tiny_whisper):
    """A 3.5 s audio (the tiny model hears 2 s): each piece's segments from its tokens (which equal transformers':
    above), shifted by the piece's offset, are `transcribe_segments`'; verbose_json, srt and vtt answer them."""
    wav = wav_bytes(make_audio(3.5, seed=4))
    waveform = read_audio(wav, "file", SAMPLING_RATE).waveform
    speech, params = engine.speech_to_text, SamplingParams(temperature=0.0, max_tokens=TIMED_TOKENS)
    segments = await engine.transcribe_segments(waveform, params=params)
    requests = speech.requests(TIMED, waveform)
    outs = await asyncio.gather(*(engine.generate(request, params) for request in requests))
    expected = []
    for out, (offset, seconds) in zip(outs, speech.piece_times(requests)):
        expected += speech.segments(out.outputs[0].token_ids, offset, seconds, _decoder(engine),
                                    set(engine.eos_token_ids))
    assert len(requests) == 2 and segments == expected and any(s.start >= requests[0]["multi_modal_data"]["audio"][
        0].size / SAMPLING_RATE for s in segments)
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        async def post(**fields) -> object:
            return await client.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav, "audio/wav")},
                                     data={"max_completion_tokens": str(TIMED_TOKENS), **fields})

        verbose = (await post(response_format="verbose_json", **{"timestamp_granularities[]": "segment"})).json()
        assert [(s["start"], s["end"], s["text"], s["tokens"]) for s in verbose["segments"]] == [
            (s.start, s.end, s.text, list(s.token_ids)) for s in segments]
        assert verbose["text"] == "".join(s.text for s in segments) and verbose["language"] == "en"
        assert verbose["duration"] == 3.5 and verbose["task"] == "transcribe"
        assert (await post(response_format="srt")).text == srt(segments)
        assert (await post(response_format="vtt")).text == vtt(segments)
        for fields, field in ((dict(response_format="verbose_json", **{"timestamp_granularities[]": "word"}),
                               "word timestamps are not built"),
                              ({"timestamp_granularities[]": "segment"}, "needs response_format 'verbose_json'"),
                              (dict(response_format="srt", stream="true"), "answered whole")):
            reply = await post(**fields)
            assert reply.status_code == 400 and field in reply.json()["error"]["message"], reply.text


def _decoder(engine: AsyncEngine):
    return lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
async def test_transcribe_gives_the_same_text_whatever_the_output_kind(engine, kind) -> None:
    """`transcribe` hands out each piece's new text once, whatever ``params.output_kind`` the caller passes: a
    CUMULATIVE one repeated the text before each snapshot (asyncllm/speech.py `_one_sample`)."""
    wav = wav_bytes(make_audio(1.5 * CHUNK_SECONDS, seed=4))  # two pieces
    expected = "".join([text async for text in engine.transcribe(wav, params=SamplingParams(
        temperature=0.0, max_tokens=8))])
    assert expected
    got = "".join([text async for text in engine.transcribe(
        wav, params=SamplingParams(temperature=0.0, max_tokens=8, output_kind=kind))])
    assert got == expected
