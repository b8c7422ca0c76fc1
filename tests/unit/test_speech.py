"""asyncllm/speech.py: long audio cut at its quiet moments, and Whisper's decoder prompts per task and language."""

from __future__ import annotations

import numpy as np
import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.speech import SpeechToText, split_audio

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
