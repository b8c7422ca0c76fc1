"""asyncllm/speech.py: long audio cut at its quiet moments, and Whisper's decoder prompts per task and language."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import SamplingParams
from asyncllm.speech import SpeechToText, speech_to_text_of, split_audio, transcribe, transcribe_segments

RATE = 1000


def test_long_audio_is_cut_in_its_quietest_moment_before_each_limit():
    rng = np.random.default_rng(0)
    waveform = rng.uniform(-1, 1, 5 * RATE).astype(np.float32)
    waveform[1600:1650] = 0.0  # a pause in the last second before the first 2 s limit
    pieces = split_audio(waveform, RATE, 2.0)
    assert 1600 <= pieces[0].size <= 1640  # cut inside the pause, not at the limit
    assert all(piece.size <= 2 * RATE for piece in pieces) and len(pieces) == 3
    assert np.array_equal(np.concatenate(pieces), waveform)  # nothing lost, nothing repeated
    assert [p.size for p in split_audio(waveform[:2 * RATE], RATE, 2.0)] == [2 * RATE]  # short enough: whole


def _speech(multilingual: bool = True, prev: bool = True) -> SpeechToText:
    vocab = {"<|startoftranscript|>", "<|en|>", "<|fr|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>"}
    return SpeechToText(16000, 30.0, multilingual, frozenset(vocab | ({"<|startofprev|>"} if prev else set())))


def test_prompts_follow_the_task_language_and_context():
    speech = _speech()
    assert speech.prompt("transcribe", None, None) == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    assert speech.prompt("translate", "fr", " Bonjour ") == (
        "<|startofprev|> Bonjour<|startoftranscript|><|fr|><|translate|><|notimestamps|>")
    assert _speech(multilingual=False).prompt("transcribe", "en", None) == "<|startoftranscript|><|notimestamps|>"


@pytest.mark.parametrize("speech, args, field", [
    (_speech(), ("transcribe", "xx", None), "language"),
    (_speech(prev=False), ("transcribe", "en", "hint"), "prompt"),
    (_speech(multilingual=False), ("translate", None, None), "task"),
    (_speech(multilingual=False), ("transcribe", "fr", None), "language"),
])
def test_what_a_model_cannot_do_is_refused_by_name(speech, args, field):
    with pytest.raises(InvalidRequestError) as info:
        speech.prompt(*args)
    assert info.value.field == field


def test_timestamp_tokens_become_segments_and_subtitles():
    """`<|start|> text <|end|>` pairs, the next opening after a closing one, text left open ending at the piece's
    end; times clamped to the piece and shifted by its offset; EOS and empty segments dropped; srt / vtt cues."""
    from asyncllm.speech_segments import segments_of, srt, vtt

    tb, eos = 100, 1
    tokens = [tb, 5, 6, tb + 50, tb + 50, tb + 60, tb + 60, 7, tb + 400, tb + 400, 8, eos]  # 0.00 a b 1.00 1.00 ...

    def decode(ids: list[int]) -> str:
        return "".join(f" w{t}" for t in ids)

    segments = segments_of(tokens, tb, decode, offset=60.0, duration=2.5, skip={eos})
    assert [(s.start, s.end, s.text, s.token_ids) for s in segments] == [
        (60.0, 61.0, " w5 w6", (5, 6)), (61.2, 62.5, " w7", (7,)), (62.5, 62.5, " w8", (8,))]
    assert srt(segments[:2]) == "1\n00:01:00,000 --> 00:01:01,000\nw5 w6\n\n2\n00:01:01,200 --> 00:01:02,500\nw7\n\n"
    assert vtt(segments[:1]) == "WEBVTT\n\n00:01:00.000 --> 00:01:01.000\nw5 w6\n\n"
    assert _speech().prompt("transcribe", "fr", None, timestamps=False).endswith("<|notimestamps|>")
    with pytest.raises(InvalidRequestError, match="timestamp tokens"):
        _speech().prompt("transcribe", "fr", None, timestamps=True)  # this vocabulary has none
    timed = SpeechToText(16000, 30.0, True, _speech().vocab, timestamp_begin=tb)
    assert timed.prompt("translate", "fr", None, timestamps=True) == "<|startoftranscript|><|fr|><|translate|>"


def test_the_host_decides_timestamps_as_the_workers_rules_do():
    """`speech_to_text_of` takes `timestamp_rules`' decision: timestamp tokens without the task ids that ask for
    them, or past the model's vocabulary, are none (the workers then apply no timestamp rule either)."""
    vocab = {"<|en|>": 3, "<|transcribe|>": 4, "<|notimestamps|>": 5, "<|0.00|>": 6}
    mm = SimpleNamespace(needs_audio=True, feature_extractor=SimpleNamespace(sampling_rate=16000, chunk_length=30),
                         tokenizer=SimpleNamespace(get_vocab=lambda: vocab))
    whisper = {"no_timestamps_token_id": 5, "eos_token_id": 1, "task_to_id": {"transcribe": 4}}
    assert speech_to_text_of(mm, whisper, 10).timestamp_begin == 6
    assert speech_to_text_of(mm, {**whisper, "task_to_id": {}}, 10).timestamp_begin is None
    assert speech_to_text_of(mm, whisper, 6).timestamp_begin is None
    english = speech_to_text_of(mm, {**whisper, "is_multilingual": False, "decoder_start_token_id": 2}, 10)
    assert not english.multilingual and english.timestamp_begin == 6



async def test_a_transcript_of_more_than_one_sample_is_refused_before_anything_runs():
    class Untouched:  # any use of the engine (starting it, submitting a piece) fails the test
        def __getattr__(self, name):
            raise AssertionError(f"the engine's {name} was used")

    audio = (np.zeros(RATE, dtype=np.float32), RATE)
    for n in (2, 3):
        with pytest.raises(InvalidRequestError, match=f"got {n}") as refused:
            await anext(transcribe(Untouched(), audio, params=SamplingParams(n=n)))
        assert refused.value.field == "params.n"
        with pytest.raises(InvalidRequestError) as refused:
            await transcribe_segments(Untouched(), audio, params=SamplingParams(n=n))
        assert refused.value.field == "params.n"
