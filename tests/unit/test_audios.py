"""Audio inputs (asyncllm/mm/audios.py): every accepted form becomes a mono float32 waveform at the model's rate;
what is not an audio is the request's `InvalidRequestError`."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
from audio_utils import make_audio, wav_bytes

from asyncllm.errors import InvalidRequestError
from asyncllm.mm.audios import is_one_audio, read_audio

RATE = 16_000


def _stereo_wav(left: np.ndarray, right: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(2)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((np.stack([left, right], axis=1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def test_pairs_waveforms_and_files_become_the_models_rate(tmp_path) -> None:
    tone = make_audio(1.0, seed=1)
    assert np.array_equal(read_audio((tone, RATE), "a", RATE).waveform, tone)  # already at the rate: untouched
    assert np.array_equal(read_audio(tone, "a", RATE).waveform, tone)  # a bare waveform: taken at the rate
    assert np.array_equal(read_audio(tone.tolist(), "a", RATE).waveform, tone)
    high = read_audio((make_audio(1.0, seed=1, rate=44_100), 44_100), "a", RATE).waveform
    assert high.dtype == np.float32 and abs(high.size - RATE) <= 1  # one second at 16 kHz
    decoded = read_audio(wav_bytes(tone), "a", RATE).waveform
    assert np.abs(decoded - tone).max() < 1e-3  # 16-bit PCM round trip
    path = tmp_path / "a.wav"
    path.write_bytes(wav_bytes(tone, rate=8000))
    assert read_audio(str(path), "a", RATE).waveform.size == 2 * tone.size  # 8 kHz file -> twice the samples
    url = "data:audio/wav;base64," + base64.b64encode(wav_bytes(tone)).decode()
    assert np.array_equal(read_audio(url, "a", RATE).waveform, decoded)
    quiet = 0.25 * tone
    mixed = read_audio(_stereo_wav(tone, quiet, RATE), "a", RATE).waveform
    assert np.abs(mixed - (tone + quiet) / 2).max() < 1e-3  # channels averaged


def test_keys_tell_audios_apart() -> None:
    tone = make_audio(0.5, seed=2)
    key = read_audio(tone, "a", RATE).key()
    assert read_audio((tone, RATE), "a", RATE).key() == key
    assert read_audio(make_audio(0.5, seed=3), "a", RATE).key() != key
    assert read_audio(tone, "a", 8000).key() != key  # the same samples at another rate


@pytest.mark.parametrize("value, match", [
    (np.zeros((2, 10), np.float32), "1-D"),
    ((np.zeros(10, np.float32), 0), "sampling rate"),
    ((np.zeros(10, np.float32), 22050.5), "sampling rate"),
    (np.zeros(0, np.float32), "no samples"),
    (np.array([0.0, np.nan], np.float32), "NaN"),
    ("https://example.com/a.wav", "not fetched"),
    ("/no/such/file.wav", "no audio file"),
    (b"RIFF not really", "could not be decoded"),
    ("data:audio/wav;base64,@@@", "not base64"),
    ({"samples": [0.1]}, "an audio is"),
])
def test_what_is_not_an_audio_is_refused(value, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        read_audio(value, "prompt.audios[0]", RATE)


def test_one_audio_or_a_list() -> None:
    tone = make_audio(0.1, seed=4)
    assert is_one_audio((tone, RATE)) and is_one_audio(tone) and is_one_audio(b"RIFF") and is_one_audio([0.1, 0.2])
    assert not is_one_audio([(tone, RATE), (tone, RATE)]) and not is_one_audio([tone])
