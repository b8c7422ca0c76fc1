"""Audio inputs -> a checked mono float32 waveform at the model's sampling rate, with its content key.

An audio is given as vLLM's ``(waveform, sampling_rate)`` pair, a bare 1-D waveform (taken to be at the model's
rate, as vLLM takes one), or an encoded file (bytes, a local path or a ``data:`` URL; WAV, FLAC, MP3, OGG, ... what
PyAV decodes, its channels mixed down). A waveform at another rate, or a file's, is resampled by PyAV's (FFmpeg's
swresample) resampler. Remote URLs are refused, as for images.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.errors import InvalidRequestError

__all__ = ["Audio", "AudioInput", "is_one_audio", "read_audio"]

AudioInput = Any
"""``(waveform, sampling_rate)``, a 1-D waveform, bytes, a path or a ``data:`` URL."""

_MAX_SECONDS = 3600
"""Longest audio read (the feature extractors keep their own window: Whisper's 30 s)."""


@dataclass(frozen=True)
class Audio:
    """A mono float32 waveform at ``rate`` Hz."""

    waveform: np.ndarray
    rate: int

    def key(self) -> str:
        """Its content key: the samples and the rate."""
        digest = hashlib.blake2b(self.waveform.tobytes(), digest_size=16)
        digest.update(str(self.rate).encode())
        return digest.hexdigest()


def is_one_audio(value: Any) -> bool:
    """Whether vLLM's ``multi_modal_data["audio"]`` value is one audio (a pair, a waveform, a file) rather than a
    list of them."""
    if isinstance(value, tuple) and len(value) == 2 and _is_number(value[1]):
        return True
    if isinstance(value, list):  # a list of samples is one waveform; a list of audios is many
        return bool(value) and _is_number(value[0])
    return True


def _is_number(value: Any) -> bool:
    """A real number, numpy's scalars included (``np.int64(16000)``), a bool not."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def read_audio(value: AudioInput, field: str, rate: int) -> Audio:
    """One audio input as a mono float32 waveform at ``rate`` Hz; `InvalidRequestError` for anything else."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and _is_number(value[1]) and not _is_number(value[0]):
        source_rate = value[1]
        if not math.isfinite(source_rate) or source_rate <= 0 or int(source_rate) != source_rate:
            raise InvalidRequestError(field, f"a sampling rate must be a positive whole number of Hz, got {source_rate}")
        waveform = _waveform(value[0], field)
        _check_length(waveform.size, int(source_rate), field)  # before resampling: its output is bounded too
        return _checked(_resampled(waveform, int(source_rate), rate), rate, field)
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return _checked(_decoded(_file_bytes(value, field), field, rate), rate, field)
    return _checked(_waveform(value, field), rate, field)


def _waveform(value: Any, field: str) -> np.ndarray:
    try:
        array = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(field, f"an audio is (waveform, sampling_rate), a waveform or a file, got "
                                         f"{type(value).__name__}") from exc
    if array.ndim != 1:
        raise InvalidRequestError(field, f"a waveform is 1-D (mono samples), got shape {list(array.shape)}")
    return array


def _checked(waveform: np.ndarray, rate: int, field: str) -> Audio:
    if waveform.size == 0:
        raise InvalidRequestError(field, "the audio has no samples")
    _check_length(waveform.size, rate, field)
    if not np.isfinite(waveform).all():
        raise InvalidRequestError(field, "the waveform holds NaN or infinite samples")
    return Audio(np.ascontiguousarray(waveform, dtype=np.float32), rate)


def _check_length(samples: int, rate: int, field: str) -> None:
    if samples > _MAX_SECONDS * rate:
        raise InvalidRequestError(field, f"the audio is longer than {_MAX_SECONDS} s")


def _file_bytes(value: bytes | bytearray | memoryview | str, field: str) -> bytes:
    if not isinstance(value, str):
        return bytes(value)
    if value.startswith("data:"):
        _, _, payload = value.partition(",")
        try:
            return base64.b64decode(payload, validate=True)
        except ValueError as exc:
            raise InvalidRequestError(field, f"a data: URL whose payload is not base64 ({exc})") from exc
    if value.startswith(("http://", "https://")):
        raise InvalidRequestError(field, "audio URLs are not fetched: pass the file's bytes, a path or a data: URL")
    if not os.path.isfile(value):
        raise InvalidRequestError(field, f"no audio file at {value!r:.120} (a str audio is a path, or a "
                                         "data:audio/<type>;base64,... URL)")
    with open(value, "rb") as f:
        return f.read()


_AUDIO_FORMATS = "wav,w64,mp3,flac,aac,aiff,au,caf,amr,ac3,eac3,dts,truehd,wv,ape,tta,mpc,mpc8,tak,shorten,voc,xwma"
"""FFmpeg's audio-only demuxers an audio file may be read with, beside the video files' self-contained containers
(`video_files.FORMATS`: mp4/m4a, ogg, matroska/webm, asf/wma, ...)."""


def _decoded(data: bytes, field: str, rate: int) -> np.ndarray:
    """An encoded file's first audio stream, resampled to ``rate``, its channels averaged (librosa's mono, as
    vLLM and transformers load audio; FFmpeg's own downmix would scale by ``2 ** -0.5``)."""
    try:
        import av
    except ImportError as exc:
        raise InvalidRequestError(field, "audio files need PyAV: pip install 'asyncllm[multimodal]'") from exc
    from asyncllm.mm.video_files import FORMATS, OtherFileError, refuse_open

    try:  # as a video file: a self-contained format (a concat list or playlist would read the files it names)
        with av.open(io.BytesIO(data), io_open=refuse_open,
                     container_options={"format_whitelist": FORMATS + "," + _AUDIO_FORMATS}) as container:
            if not container.streams.audio:
                raise InvalidRequestError(field, "the file has no audio stream")
            stream = container.streams.audio[0]
            if (_header_seconds(container, stream) or 0) > _MAX_SECONDS:
                raise InvalidRequestError(field, f"the audio is longer than {_MAX_SECONDS} s")
            resampler = av.AudioResampler(format="fltp", rate=rate)  # planar: [channels, samples] per frame
            parts, samples = [], 0
            for decoded in container.decode(stream):
                samples += decoded.samples  # at the file's rate, counted before resampling: memory stays bounded
                _check_length(samples, decoded.sample_rate, field)
                parts += [_mono(frame) for frame in resampler.resample(decoded)]
            parts += [_mono(frame) for frame in resampler.resample(None)]
    except av.error.FFmpegError as exc:
        raise InvalidRequestError(field, f"the audio file could not be decoded ({exc})") from exc
    except OtherFileError as exc:  # the same whether that file exists or not
        raise InvalidRequestError(field, "the file names other files to read (a concat list or playlist); only "
                                         "self-contained audio files are read") from exc
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _header_seconds(container: Any, stream: Any) -> float | None:
    """The duration a file's header declares (its audio stream's, else the container's); None when unknown."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return container.duration / 1_000_000 if container.duration is not None else None  # AV_TIME_BASE units


def _mono(frame: Any) -> np.ndarray:
    """A planar frame's channels averaged."""
    return frame.to_ndarray().mean(axis=0, dtype=np.float32)


def _resampled(waveform: np.ndarray, source: int, rate: int) -> np.ndarray:
    """``waveform`` from ``source`` Hz to ``rate`` Hz (unchanged when they agree)."""
    if source == rate or waveform.size == 0:
        return waveform
    import av

    frame = av.AudioFrame.from_ndarray(waveform[None, :], format="flt", layout="mono")
    frame.sample_rate = source
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    parts = [f.to_ndarray() for f in resampler.resample(frame)] + [f.to_ndarray() for f in resampler.resample(None)]
    return np.concatenate(parts, axis=1)[0]


def audio_output_length(frames: int) -> int:
    """Encoder rows (= placeholder tokens) of an audio of ``frames`` mel frames through Whisper's front end as
    Qwen2-Audio's family pools it: the stride-2 convolution, then the pooling by 2 (asyncllm/models/qwen2_audio.py)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def post_cnn_length(frames: int) -> int:
    """Rows three (kernel 3, stride 2, padding 1) convolutions make of ``frames`` frames (none of none)."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


def qwen3_asr_output_length(frames: int, n_window: int) -> int:
    """Encoder rows (= placeholder tokens) of an audio of ``frames`` mel frames through Qwen3-ASR's (and
    Qwen3-Omni's) encoder (asyncllm/models/qwen3_asr.py): each whole chunk's of ``2 * n_window`` frames, then the
    last part's."""
    chunk = 2 * n_window
    return frames // chunk * post_cnn_length(chunk) + post_cnn_length(frames % chunk)
