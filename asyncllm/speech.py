"""Speech to text with an encoder-decoder model (Whisper: asyncllm/models/whisper.py) or Voxtral with its Mistral
tokenizer (`MistralTranscription`): what the engine tells its callers about the model's audio (`SpeechToText`,
``AsyncEngine.speech_to_text``), the decoder prompt of a task (`SpeechToText.prompt`), long audio cut into the
pieces one request hears (`split_audio`, `SpeechToText.requests`) and their texts in order (`transcribe`,
``AsyncEngine.transcribe``) or timestamped segments (`transcribe_segments`, ``AsyncEngine.transcribe_segments``;
the pieces' segments assembled once, by `piece_segments`: asyncllm/speech_segments.py). The OpenAI server's
``/v1/audio/transcriptions`` and ``/v1/audio/translations`` are built on them (integrations/openai_audio.py).
Whether the checkpoint has timestamp tokens is decided with the workers' rules (asyncllm/generation_config.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import numpy as np

from asyncllm.engine.admission import admission_group
from asyncllm.errors import InvalidRequestError
from asyncllm.generation_config import timestamp_rules
from asyncllm.mistral_tokenizer import is_mistral, mistral_transcribes, render_mistral_transcription
from asyncllm.sampling import RequestOutputKind, SamplingParams
from asyncllm.speech_segments import Segment, segments_of

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine

__all__ = ["MistralTranscription", "SpeechToText", "piece_segments", "speech_to_text_of", "split_audio", "transcribe",
           "transcribe_segments"]

logger = logging.getLogger("asyncllm.engine")

_SEARCH_SECONDS = 1.0
"""A cut between two pieces of a long audio falls at its quietest moment in the last second before the limit."""
_FRAME_SECONDS = 0.01
"""The quietness is measured over frames this long (their mean square)."""


@dataclass(frozen=True)
class SpeechToText:
    """A speech-to-text model's audio: the rate its features are taken at, the seconds one request hears, and the
    decoder's task tokens (Whisper's)."""

    sampling_rate: int
    chunk_seconds: float | None
    """None: the whole audio in one request (Voxtral: the host cuts its 30 s windows, as mistral_common does)."""
    multilingual: bool
    """False for the English-only checkpoints (``*.en``): their prompt has no language or task token."""
    vocab: frozenset[str]
    """The task, language and context tokens the tokenizer has (``<|en|>``, ``<|translate|>``, ``<|startofprev|>``,
    ...)."""
    timestamp_begin: int | None = None
    """The id of ``<|0.00|>`` (generation_config's ``no_timestamps_token_id`` + 1); None: no timestamp tokens
    (`asyncllm.generation_config.timestamp_rules` decides, for the workers' rules too)."""

    def prompt(self, task: str, language: str | None, context: str | None, timestamps: bool = False) -> str:
        """The decoder prompt of ``task`` ("transcribe" or "translate") in ``language`` (None: English), after the
        ``context`` text (OpenAI's ``prompt``: the previous transcript, spelling hints), as Whisper was trained;
        with ``timestamps``, without ``<|notimestamps|>`` (the engine then applies Whisper's timestamp rules:
        workers/generation_rules.py)."""
        if timestamps and self.timestamp_begin is None:
            raise InvalidRequestError("timestamps", "a checkpoint with timestamp tokens (generation_config.json's "
                                                    "no_timestamps_token_id): this one has none")
        last = "" if timestamps else "<|notimestamps|>"
        head = ""
        if context:
            if "<|startofprev|>" not in self.vocab:
                raise InvalidRequestError("prompt", "a context prompt needs the tokenizer's <|startofprev|> token")
            head = "<|startofprev|> " + context.strip()
        if not self.multilingual:
            if task != "transcribe" or language not in (None, "en"):
                raise InvalidRequestError("language" if task == "transcribe" else "task",
                                          "English transcription only: this checkpoint is English-only")
            return head + "<|startoftranscript|>" + last
        language = language or "en"
        if f"<|{language}|>" not in self.vocab:
            raise InvalidRequestError("language", f"a language the model knows (ISO-639-1, e.g. 'en'), got "
                                                  f"{language!r}")
        return head + f"<|startoftranscript|><|{language}|><|{task}|>" + last

    def requests(self, prompt: str | list[int], waveform: np.ndarray) -> list[dict[str, Any]]:
        """The prompts of a waveform at `sampling_rate`: one per piece of at most `chunk_seconds` (`split_audio`;
        None: one piece), each ``prompt`` (a text, or `MistralTranscription`'s ids) with its piece."""
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        pieces = [waveform] if self.chunk_seconds is None else split_audio(waveform, self.sampling_rate,
                                                                             self.chunk_seconds)
        return [{key: prompt, "multi_modal_data": {"audio": (piece, self.sampling_rate)}} for piece in pieces]

    def piece_times(self, requests: list[dict[str, Any]]) -> list[tuple[float, float]]:
        """(offset, seconds) of each request's piece in the whole audio (`requests`' order)."""
        lengths = [request["multi_modal_data"]["audio"][0].size / self.sampling_rate for request in requests]
        return [(sum(lengths[:i]), length) for i, length in enumerate(lengths)]

    def segments(self, token_ids: list[int], offset: float, seconds: float, decode: Any,
                 eos_token_ids: Any = ()) -> list[Segment]:
        """The timestamped segments of one piece's output tokens (asyncllm/speech_segments.py)."""
        assert self.timestamp_begin is not None, "prompt(timestamps=True) refuses a checkpoint without them"
        return segments_of(token_ids, self.timestamp_begin, decode, offset=offset, duration=seconds,
                           skip=eos_token_ids)


@dataclass(frozen=True)
class MistralTranscription(SpeechToText):
    """Voxtral's transcription with a Mistral tokenizer: the prompt is mistral_common's transcription request's
    (asyncllm/mistral_tokenizer.py), the whole audio in one request as vLLM's Voxtral (its windows fill the
    ``[AUDIO]`` run, so a long audio is bounded by ``max_model_len``: 375 tokens per 30 s); no translation, context
    prompt or timestamps, which the request does not have."""

    tokenizer: Any = None
    """The engine's `MistralCommonBackend`."""

    def prompt(self, task: str, language: str | None, context: str | None, timestamps: bool = False) -> list[int]:
        """The prompt ids of a transcription in ``language`` (None: the model tells it); what the request cannot
        say is an `InvalidRequestError` naming it."""
        if task != "transcribe":
            raise InvalidRequestError("task", "'transcribe': mistral_common's transcription request (Voxtral) has no "
                                              "translation; ask for one in a chat")
        if context:
            raise InvalidRequestError("prompt", "none: mistral_common's transcription request (Voxtral) takes no "
                                                "prompt text")
        if timestamps:
            raise InvalidRequestError("timestamps", "a checkpoint with timestamp tokens: Voxtral has none")
        return render_mistral_transcription(self.tokenizer, language)


def speech_to_text_of(mm: Any, generation: Mapping[str, Any], vocab_size: int) -> SpeechToText | None:
    """The `SpeechToText` of a model whose host processor needs an audio per prompt (Whisper), or the
    `MistralTranscription` of an audio model whose Mistral tokenizer encodes transcriptions (Voxtral), else None;
    ``generation`` is its generation_config.json's keys (asyncllm/generation_config.py), whose timestamp tokens the
    workers' rules use too (`timestamp_rules`, with the model's ``vocab_size``)."""
    if mm is None:
        return None
    if getattr(mm, "needs_audio", None) is None:
        return _mistral_transcription(mm)
    extractor = mm.feature_extractor
    special = {token for token in mm.tokenizer.get_vocab() if token.startswith("<|") and token.endswith("|>")}
    timestamps = timestamp_rules(generation, vocab_size)
    if "is_multilingual" not in generation:
        logger.warning("no generation config says whether the speech model is multilingual: it is prompted as a "
                       "multilingual one (an English-only checkpoint needs its generation_config.json)")
    return SpeechToText(int(extractor.sampling_rate), float(extractor.chunk_length),
                        bool(generation.get("is_multilingual", True)), frozenset(special),
                        None if timestamps is None else timestamps.timestamp_begin)


def _mistral_transcription(mm: Any) -> MistralTranscription | None:
    """Voxtral's transcription when its tokenizer is mistral_common's and encodes one (`mistral_transcribes`); a
    transformers tokenizer has no transcription request to follow: None."""
    if getattr(mm, "audio_token_id", None) is None or not is_mistral(mm.tokenizer):
        return None
    if not mistral_transcribes(mm.tokenizer):
        return None
    return MistralTranscription(int(mm.feature_extractor.sampling_rate), None, True, frozenset(),
                                tokenizer=mm.tokenizer)


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
    params = _one_sample(params)
    speech, waveform = await _speech_audio(engine, audio, task)
    text = speech.prompt(task, language, prompt)
    requests = speech.requests(text, waveform)
    with admission_group(len(requests)):  # the pieces are admitted together
        streams = [engine.stream(request, params) for request in requests]
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


async def transcribe_segments(engine: AsyncEngine, audio: Any, *, task: str = "transcribe",
                              language: str | None = None, prompt: str | None = None,
                              params: SamplingParams | None = None) -> list[Segment]:
    """The timestamped segments of ``audio`` (Whisper's timestamp tokens; times from the start of the whole audio), once
    every piece is done: `transcribe`'s pieces, each prompted without ``<|notimestamps|>``."""
    params = _one_sample(params)
    speech, waveform = await _speech_audio(engine, audio, task)
    requests = speech.requests(speech.prompt(task, language, prompt, timestamps=True), waveform)
    with admission_group(len(requests)):  # the pieces are admitted together: the tasks inherit the group
        pieces = [asyncio.ensure_future(engine.generate(request, params)) for request in requests]
    try:
        outs = await asyncio.gather(*pieces)
    finally:  # one piece failed (or the caller gave up): the others are aborted, not run to their end
        for piece in pieces:
            piece.cancel()
    return await piece_segments(engine, requests, [out.outputs[0].token_ids for out in outs])


async def piece_segments(engine: AsyncEngine, requests: list[dict[str, Any]],
                         token_ids: Sequence[list[int]]) -> list[Segment]:
    """The timestamped segments of a long audio's pieces (`SpeechToText.requests`) from each piece's output
    tokens, times from the start of the whole audio, decoded off the event loop (`transcribe_segments` and the
    OpenAI routes' timed formats: integrations/openai_audio.py)."""
    speech, tokenizer, eos = engine.speech_to_text, engine.tokenizer, frozenset(engine.eos_token_ids)
    assert speech is not None, "the callers refuse a model that does not transcribe"

    def segments() -> list[Segment]:
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)
        return [segment for ids, (offset, seconds) in zip(token_ids, speech.piece_times(requests))
                for segment in speech.segments(ids, offset, seconds, decode, eos)]

    return await anyio.to_thread.run_sync(segments)


def _one_sample(params: SamplingParams | None) -> SamplingParams:
    """``params`` (None: greedy, as long as ``max_model_len`` allows), refused unless they ask for one sample: a
    transcript is one text (the OpenAI routes take no ``n`` either); their ``output_kind`` DELTA, as `transcribe`
    hands out each delta's text once (a CUMULATIVE snapshot would repeat the text before it)."""
    if params is None:
        return SamplingParams(temperature=0.0, max_tokens=None)
    if params.n != 1:
        raise InvalidRequestError("params.n", f"1 (a transcript is one sample), got {params.n}")
    if params.output_kind != RequestOutputKind.DELTA:
        params.validate()  # a bad output_kind (a typo) is refused, not replaced
        params = msgspec.structs.replace(params, output_kind=RequestOutputKind.DELTA)
    return params


async def _speech_audio(engine: AsyncEngine, audio: Any, task: str) -> tuple[SpeechToText, np.ndarray]:
    """The engine's `SpeechToText` and ``audio``'s waveform at its rate (decoded off the event loop)."""
    from asyncllm.mm.audios import read_audio

    if task not in ("transcribe", "translate"):
        raise InvalidRequestError("task", f"'transcribe' or 'translate', got {task!r}")
    await engine.start()
    speech = engine.speech_to_text
    if speech is None:
        raise InvalidRequestError("model", "a speech-to-text model (Whisper, or Voxtral with tokenizer_mode="
                                           "'mistral'): this engine's model does not transcribe")
    return speech, (await anyio.to_thread.run_sync(read_audio, audio, "audio", speech.sampling_rate)).waveform
