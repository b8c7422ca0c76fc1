"""Whisper's timestamped output as segments (`Segment`, `segments_of`) and the subtitle formats the OpenAI audio
routes answer (`srt`, `vtt`, `verbose_json`).

A timestamp token ``<|t|>`` is ``timestamp_begin + t / 0.02``; the model writes ``<|start|> text <|end|>``, the next
segment's ``<|start|>`` after it (the timestamp rules keep them paired: workers/generation_rules.py). Times are the
piece's plus its offset in the whole audio (a long audio is cut into pieces: asyncllm/speech.py)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TIME_PRECISION", "Segment", "segments_of", "srt", "verbose_json", "vtt"]

TIME_PRECISION = 0.02
"""Seconds per timestamp token (Whisper's: 30 s over 1500 encoder rows)."""


@dataclass(frozen=True)
class Segment:
    """A stretch of the audio and its text (seconds from the start of the whole audio)."""

    start: float
    end: float
    text: str
    token_ids: tuple[int, ...]
    """Its text tokens (no timestamps, no EOS)."""


def segments_of(token_ids: Sequence[int], timestamp_begin: int, decode: Callable[[list[int]], str], *,
                offset: float = 0.0, duration: float, skip: Collection[int] = ()) -> list[Segment]:
    """The segments of one piece's output tokens: text between an opening and a closing timestamp; text left open
    (the output stopped before its closing timestamp) ends at the piece's ``duration``. Times are clamped to the
    piece and shifted by ``offset``; ``skip`` ids (EOS) are dropped; a segment whose text is empty is left out."""
    segments: list[Segment] = []
    start: float | None = None
    text: list[int] = []

    def close(begin: float, end: float) -> None:
        words = decode(text)
        if words.strip():
            segments.append(Segment(round(offset + min(begin, duration), 3), round(offset + min(end, duration), 3),
                                    words, tuple(text)))

    for token in token_ids:
        if token >= timestamp_begin:
            time = (token - timestamp_begin) * TIME_PRECISION
            if start is None:
                start = time
            else:
                close(start, time)
                start, text = None, []
        elif token not in skip:
            text.append(token)
    if text:
        close(0.0 if start is None else start, duration)
    return segments


def srt(segments: Sequence[Segment]) -> str:
    """SubRip subtitles: numbered cues ``HH:MM:SS,mmm --> HH:MM:SS,mmm`` and their text."""
    return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{_cue_text(s)}\n\n"
                   for i, s in enumerate(segments, 1))


def vtt(segments: Sequence[Segment]) -> str:
    """WebVTT subtitles: the ``WEBVTT`` header, then cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm`` and their text."""
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{_cue_text(s)}\n\n"
                                  for s in segments)


def _cue_text(segment: Segment) -> str:
    """A cue's text: stripped, ``-->`` written ``->`` (a cue's text may not hold the timing arrow; OpenAI whisper's
    writers replace it so)."""
    return segment.text.strip().replace("-->", "->")


def verbose_json(task: str, language: str, duration: float, segments: Sequence[Segment],
                 temperature: float) -> dict[str, Any]:
    """OpenAI's ``verbose_json`` transcription: the task, language, duration, whole text and each segment."""
    return {"task": task, "language": language, "duration": round(duration, 3),
            "text": "".join(s.text for s in segments),
            "segments": [{"id": i, "start": s.start, "end": s.end, "text": s.text,
                          "tokens": list(s.token_ids), "temperature": temperature}
                         for i, s in enumerate(segments)]}


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"
