"""Speech to text with an encoder-decoder model (Whisper: asyncllm/models/whisper.py): what the engine tells its
callers about the model's audio (`SpeechToText`, ``AsyncEngine.speech_to_text``), the decoder prompt of a task
(`SpeechToText.prompt`) and long audio cut into the pieces one request hears (`split_audio`). The OpenAI server's
``/v1/audio/transcriptions`` and ``/v1/audio/translations`` are built on them (integrations/openai_audio.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.errors import InvalidRequestError

__all__ = ["SpeechToText", "speech_to_text_of", "split_audio"]

_SEARCH_SECONDS = 1.0
"""A cut between two pieces of a long audio falls at its quietest moment in the last second before the limit."""
_FRAME_SECONDS = 0.01
"""The quietness is measured over frames this long (their mean square)."""


@dataclass(frozen=True)
class SpeechToText:
    """A speech-to-text model's audio: the rate its features are taken at, the seconds one request hears, and the
    decoder's task tokens (Whisper's)."""

    sampling_rate: int
    chunk_seconds: float
    multilingual: bool
    """False for the English-only checkpoints (``*.en``): their prompt has no language or task token."""
    vocab: frozenset[str]
    """The task, language and context tokens the tokenizer has (``<|en|>``, ``<|translate|>``, ``<|startofprev|>``,
    ...)."""

    def prompt(self, task: str, language: str | None, context: str | None) -> str:
        """The decoder prompt of ``task`` ("transcribe" or "translate") in ``language`` (None: English), after the
        ``context`` text (OpenAI's ``prompt``: the previous transcript, spelling hints), as Whisper was trained."""
        head = ""
        if context:
            if "<|startofprev|>" not in self.vocab:
                raise InvalidRequestError("prompt", "a context prompt needs the tokenizer's <|startofprev|> token")
            head = "<|startofprev|> " + context.strip()
        if not self.multilingual:
            if task != "transcribe" or language not in (None, "en"):
                raise InvalidRequestError("language" if task == "transcribe" else "task",
                                          "English transcription only: this checkpoint is English-only")
            return head + "<|startoftranscript|><|notimestamps|>"
        language = language or "en"
        if f"<|{language}|>" not in self.vocab:
            raise InvalidRequestError("language", f"a language the model knows (ISO-639-1, e.g. 'en'), got "
                                                  f"{language!r}")
        return head + f"<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>"


def speech_to_text_of(mm: Any, model_path: str) -> SpeechToText | None:
    """The `SpeechToText` of a model whose host processor needs an audio per prompt (Whisper), else None."""
    if mm is None or getattr(mm, "needs_audio", None) is None:
        return None
    extractor = mm.feature_extractor
    generation: dict[str, Any] = {}
    path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            generation = json.load(f)
    special = {token for token in mm.tokenizer.get_vocab() if token.startswith("<|") and token.endswith("|>")}
    return SpeechToText(int(extractor.sampling_rate), float(extractor.chunk_length),
                        bool(generation.get("is_multilingual", True)), frozenset(special))


def split_audio(waveform: np.ndarray, rate: int, seconds: float) -> list[np.ndarray]:
    """``waveform`` in pieces of at most ``seconds``, each cut at the quietest moment of the last second before its
    limit (so that a cut seldom falls inside a word); one piece when it is short enough."""
    limit, search = int(seconds * rate), int(min(_SEARCH_SECONDS, seconds / 2) * rate)
    pieces, start = [], 0
    while waveform.size - start > limit:
        window = waveform[start + limit - search:start + limit]
        cut = start + limit - search + _quietest(window, max(1, int(_FRAME_SECONDS * rate)))
        pieces.append(waveform[start:cut])
        start = cut
    pieces.append(waveform[start:])
    return pieces


def _quietest(window: np.ndarray, frame: int) -> int:
    """The offset in ``window`` of the start of its quietest frame of ``frame`` samples."""
    frames = window[:window.size - window.size % frame].reshape(-1, frame)
    if not len(frames):
        return window.size
    return int(np.argmin((frames.astype(np.float64) ** 2).mean(axis=1))) * frame
