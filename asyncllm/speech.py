"""Speech to text with an encoder-decoder model (Whisper: asyncllm/models/whisper.py): what the engine tells its
callers about the model's audio (`SpeechToText`, ``AsyncEngine.speech_to_text``), the decoder prompt of a task
(`SpeechToText.prompt`), long audio cut into the pieces one request hears (`split_audio`, `SpeechToText.requests`) and their texts in order
(`transcribe`, ``AsyncEngine.transcribe``). The OpenAI server's ``/v1/audio/transcriptions`` and
``/v1/audio/translations`` are built on them (integrations/openai_audio.py)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import SamplingParams

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine

__all__ = ["SpeechToText", "speech_to_text_of", "split_audio", "transcribe"]

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

    def requests(self, prompt: str, waveform: np.ndarray) -> list[dict[str, Any]]:
        """The prompts of a waveform at `sampling_rate`: one per piece of at most `chunk_seconds` (`split_audio`),
        each ``prompt`` with its piece."""
        return [{"prompt": prompt, "multi_modal_data": {"audio": (piece, self.sampling_rate)}}
                for piece in split_audio(waveform, self.sampling_rate, self.chunk_seconds)]


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


async def transcribe(engine: AsyncEngine, audio: Any, *, task: str = "transcribe", language: str | None = None,
                     prompt: str | None = None, params: SamplingParams | None = None) -> AsyncIterator[str]:
    """The text of ``audio`` (any audio input: asyncllm/mm/audios.py) as it comes: a long audio's pieces all run at
    once, their texts handed out in order. Leaving the loop aborts every piece still running."""
    from asyncllm.mm.audios import read_audio

    if task not in ("transcribe", "translate"):
        raise InvalidRequestError("task", f"'transcribe' or 'translate', got {task!r}")
    await engine.start()
    speech = engine.speech_to_text
    if speech is None:
        raise InvalidRequestError("model", "a speech-to-text model (Whisper): this engine's model does not transcribe")
    text = speech.prompt(task, language, prompt)
    waveform = (await anyio.to_thread.run_sync(read_audio, audio, "audio", speech.sampling_rate)).waveform
    params = params or SamplingParams(temperature=0.0, max_tokens=None)
    streams = [engine.stream(request, params) for request in speech.requests(text, waveform)]
    firsts = [asyncio.ensure_future(stream.__anext__()) for stream in streams]  # every piece submitted now
    try:
        for first, stream in zip(firsts, streams):
            try:
                delta = await first
            except StopAsyncIteration:
                continue
            if delta.text:
                yield delta.text
            async for delta in stream:
                if delta.text:
                    yield delta.text
    finally:
        for first in firsts:
            first.cancel()
        for stream in streams:
            await stream.aclose()
