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
from asyncllm.mm import audios
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


def _one_hz_wav(samples: int) -> bytes:
    """A tiny 8-bit WAV whose header claims 1 Hz: each byte is a second, 16000 samples once at 16 kHz."""
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(1)
        f.setframerate(1)
        f.writeframes(bytes(128 + i % 7 for i in range(samples)))
    return out.getvalue()


@pytest.fixture
def resampled(monkeypatch) -> list[int]:
    """The source samples each resampler call gets (a pair's ``_resampled`` and a file's ``av.AudioResampler``)."""
    import av

    seen: list[int] = []
    real = av.AudioResampler

    class Counting:
        def __init__(self, *args, **kwargs) -> None:
            self._real = real(*args, **kwargs)

        def resample(self, frame):
            seen.append(0 if frame is None else frame.samples)
            return self._real.resample(frame)

    monkeypatch.setattr(av, "AudioResampler", Counting)
    monkeypatch.setattr(audios, "_resampled", lambda w, *_: seen.append(w.size) or w)
    return seen


def test_too_long_audio_is_refused_before_resampling(monkeypatch, resampled: list[int]) -> None:
    with pytest.raises(InvalidRequestError, match="longer than 3600 s"):  # the header says 3601 s: nothing decoded
        read_audio(_one_hz_wav(3601), "a", RATE)
    with pytest.raises(InvalidRequestError, match="longer than 3600 s"):  # a pair: its length and rate
        read_audio((np.zeros(3601, np.float32), 1), "a", RATE)
    assert resampled == []
    monkeypatch.setattr(audios, "_MAX_SECONDS", 10)
    monkeypatch.setattr(audios, "_header_seconds", lambda *_: None)  # a header that tells no duration
    with pytest.raises(InvalidRequestError, match="longer than 10 s"):
        read_audio(_one_hz_wav(100), "a", RATE)
    assert 0 < sum(resampled) <= 10  # decoding stopped at the bound, before resampling past it


def test_numpy_scalar_rates_make_pairs() -> None:
    tone = make_audio(0.1, seed=5)
    for rate in (np.int64(RATE), np.float32(RATE), float(RATE)):
        assert is_one_audio((tone, rate)) and np.array_equal(read_audio((tone, rate), "a", RATE).waveform, tone)
    assert is_one_audio(list(tone.astype(np.float64)))  # a list of numpy samples is one waveform
    with pytest.raises(InvalidRequestError, match="an audio is"):
        read_audio((tone, True), "a", RATE)  # a bool is no rate
    for rate in (float("nan"), np.float64("inf")):  # named as a bad rate of its field, not a failed conversion
        with pytest.raises(InvalidRequestError, match="positive whole number of Hz"):
            read_audio((tone, rate), "a", RATE)
