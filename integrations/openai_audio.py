"""OpenAI's speech-to-text routes for a Whisper engine: ``POST /v1/audio/transcriptions`` and
``/v1/audio/translations`` (multipart forms, as OpenAI's and vLLM's); a Voxtral engine with a Mistral tokenizer
answers transcriptions of the whole audio in one request (asyncllm/speech.py's `MistralTranscription`).

The uploaded file (any format PyAV decodes, at most `ServerLimits.max_audio_bytes`) is decoded off the event loop
and resampled to the model's rate; an audio longer than the model hears at once (Whisper: 30 s) is cut at its quiet
moments into pieces (asyncllm/speech.py), each transcribed by its own request, all at once, their texts joined in
order. ``response_format`` "json" answers ``{"text", "usage"}`` (the audio's seconds, as vLLM), "text" the bare
text; "verbose_json", "srt" and "vtt" prompt without ``<|notimestamps|>`` and answer the pieces' timestamped segments
(asyncllm/speech_segments.py; ``timestamp_granularities`` "segment" only); ``stream=true`` sends server-sent
events, each both OpenAI's (``{"type": "transcript.text.delta", "delta"}``, then ``"transcript.text.done"``) and
vLLM's (``"object": "transcription.chunk"`` with ``choices[0].delta.content``), with ``stream_include_usage`` vLLM's
usage chunk, then ``[DONE]``. A client that
leaves aborts every piece. docs/integrations/openai-server.md has the details.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm.engine.admission import admission_group
from asyncllm.errors import AsyncLLMError, InvalidRequestError
from asyncllm.integrations.errors import ApiError, error_body, renamed_fields
from asyncllm.integrations.openai_http import EventStream, json_response
from asyncllm.integrations.openai_request_log import log_under, route_id
from asyncllm.integrations.openai_responses import sse_event
from asyncllm.integrations.starlette import wait_disconnect
from asyncllm.integrations.streams import ClientDisconnected, first_deltas, merge_streams
from asyncllm.mm.audios import read_audio
from asyncllm.sampling import SamplingParams
from asyncllm.speech import piece_segments
from asyncllm.speech_segments import srt, verbose_json, vtt

if TYPE_CHECKING:
    from asyncllm.engine.stream import RequestStream
    from asyncllm.integrations.openai_server import OpenAIServer

__all__ = ["audio_routes"]

_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "stream", "stream_include_usage",
           "timestamp_granularities[]", "timestamp_granularities", "seed", "max_completion_tokens", "priority"}
"""The form fields the routes read; any other is refused by name."""
_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
_TIMED = ("verbose_json", "srt", "vtt")
"""The formats with timestamps: the pieces are prompted without ``<|notimestamps|>`` (asyncllm/speech.py)."""
_LISTS = ("timestamp_granularities[]", "timestamp_granularities")
"""Fields a form may repeat: their values are kept as a list."""
_FORM_MARGIN = 64 << 10
"""Bytes a body may hold past ``max_audio_bytes`` (the other fields, the parts' headers and boundaries) before its
declared ``content-length`` is a 413 unread: the file itself is held to ``max_audio_bytes`` exactly (`_file_bytes`)."""


def audio_routes(server: OpenAIServer) -> list[Route]:
    async def transcriptions(request: Request) -> Response:
        return await _speech(server, request, "transcribe")

    async def translations(request: Request) -> Response:
        return await _speech(server, request, "translate")

    return [Route("/v1/audio/transcriptions", server._guarded(transcriptions), methods=["POST"]),
            Route("/v1/audio/translations", server._guarded(translations), methods=["POST"])]


async def _speech(server: OpenAIServer, request: Request, task: str) -> Response:
    if not server.engine.started:
        await server.engine.start()
    speech = server.engine.speech_to_text
    if speech is None:
        raise InvalidRequestError("model", "a speech-to-text model (Whisper, or Voxtral with tokenizer_mode="
                                           "'mistral'): this server's model does not transcribe audio")
    form = await _form(request, server.limits.max_audio_bytes)
    model, lora = server._model(form.get("model"))
    response_format = form.get("response_format") or "json"  # an empty field left out, as FastAPI's forms
    if response_format not in _FORMATS:
        raise InvalidRequestError("response_format", f"one of {', '.join(_FORMATS)}, got {response_format!r}")
    timed = response_format in _TIMED
    _check_timestamps(form, response_format, speech.timestamp_begin is not None)
    language = form.get("language") or None
    prompt = speech.prompt(task, language, form.get("prompt"), timestamps=timed)
    audio = await _audio(form, speech.sampling_rate)
    params = SamplingParams(temperature=_parsed(form, "temperature", float, "a number", 0.0),
                            max_tokens=_parsed(form, "max_completion_tokens", _integer, "an integer"),  # vLLM's; left
                            seed=_parsed(form, "seed", _integer, "an integer"))  # out: what max_model_len allows
    with renamed_fields({"max_tokens": "max_completion_tokens"}):  # checked here to name the form's field
        params.validate()
    priority = _parsed(form, "priority", _integer, "an integer", 0)
    stream, usage = _flag(form, "stream"), _flag(form, "stream_include_usage")  # refused before anything is queued
    request_id = route_id(task, request.headers)  # vLLM's "transcribe-ID", "translate-ID": the client's prompt
    log_under(server.request_log, request_id, [form.get("prompt") or ""], params, lora, indexed=False)
    requests = speech.requests(prompt, audio)
    with admission_group(len(requests)):  # the request's group (`guard`) may pass the limits by its pieces
        streams = [server.engine.stream(request, params, lora_request=lora, priority=priority) for request in requests]
    seconds = math.ceil(audio.size / speech.sampling_rate)
    if timed:
        return await _timed_response(server, request, streams, requests, response_format,
                                     (task, language or "en", audio.size / speech.sampling_rate, params.temperature))
    if stream:
        meta = {"id": request_id, "object": "transcription.chunk", "created": int(time.time()),
                "model": model}
        # errors before the first token keep their status code; a client gone while queued is a 499 (`guard`)
        firsts = await first_deltas(streams, until=lambda: wait_disconnect(request))
        return EventStream(_events(request, streams, firsts, meta, usage or server.force_include_usage))
    text = "".join([piece async for piece in _texts_in_order(request, streams)])
    if response_format == "text":
        return Response(text, media_type="text/plain; charset=utf-8")
    return json_response({"text": text, "usage": {"type": "duration", "seconds": seconds}})


async def _form(request: Request, limit: int) -> dict[str, Any]:
    """The multipart form's fields (the file's bytes under ``file``); 413 past ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + _FORM_MARGIN:
        raise ApiError(413, f"the upload is larger than {limit} bytes (max_audio_bytes)", "invalid_request_error")
    try:
        async with request.form(max_files=1, max_fields=len(_FIELDS)) as form:
            fields: dict[str, Any] = {}
            for key, value in form.multi_items():
                if key not in _FIELDS:
                    raise InvalidRequestError(key, f"not a field of this route (it takes {', '.join(sorted(_FIELDS))})")
                if key in _LISTS:
                    fields.setdefault(key, []).append(value)
                else:
                    fields[key] = await _file_bytes(value, limit) if isinstance(value, UploadFile) else value
    except AssertionError as exc:  # starlette without python-multipart
        raise ApiError(500, f"multipart forms need python-multipart: pip install 'asyncllm[server]' ({exc})",
                       "server_error") from exc
    except (ApiError, InvalidRequestError):
        raise
    except ClientDisconnect:  # gone mid-upload: a quiet 499, as `read_body`
        raise ClientDisconnected() from None
    except Exception as exc:  # noqa: BLE001 - starlette's MultiPartException, a malformed body
        raise InvalidRequestError("body", f"a multipart/form-data body with the audio as 'file' ({exc})") from exc
    if not isinstance(fields.get("file"), bytes):
        raise InvalidRequestError("file", "the audio file is required (a multipart file part named 'file')")
    return fields


async def _file_bytes(upload: UploadFile, limit: int) -> bytes:
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise ApiError(413, f"the audio file is larger than {limit} bytes (max_audio_bytes)", "invalid_request_error")
    return data


async def _audio(form: dict[str, Any], rate: int) -> Any:
    """The file's waveform at ``rate`` Hz, decoded off the event loop."""
    decoded = await anyio.to_thread.run_sync(read_audio, form["file"], "file", rate)
    return decoded.waveform


def _check_timestamps(form: dict[str, Any], response_format: str, has_timestamps: bool) -> None:
    """400s for timestamps the route cannot give: word timestamps (not built), granularities without verbose_json, a
    timed format streamed or asked of a checkpoint without timestamp tokens."""
    granularities = [value for key in _LISTS for value in form.get(key, [])]
    for value in granularities:
        if value == "word":
            raise InvalidRequestError("timestamp_granularities", "'segment' only: word timestamps are not built")
        if value != "segment":
            raise InvalidRequestError("timestamp_granularities", f"'segment', got {value!r}")
    if granularities and response_format != "verbose_json":
        raise InvalidRequestError("timestamp_granularities", "needs response_format 'verbose_json'")
    if response_format in _TIMED and _flag(form, "stream"):
        raise InvalidRequestError("stream", f"response_format {response_format!r} is answered whole: stream with "
                                            "'json' or 'text'")
    if response_format in _TIMED and not has_timestamps:
        raise InvalidRequestError("response_format", f"{response_format!r} needs timestamp tokens (generation_config."
                                                     "json's no_timestamps_token_id): this checkpoint has none")


async def _timed_response(server: OpenAIServer, request: Request, streams: list[RequestStream],
                          pieces: list[dict[str, Any]], response_format: str,
                          about: tuple[str, str, float, float]) -> Response:
    """The segments of every piece (`piece_segments`: each piece's tokens, its offset and length) as verbose_json,
    srt or vtt."""
    tokens: list[list[int]] = [[] for _ in streams]
    async for index, delta in merge_streams(streams, (), until=lambda: wait_disconnect(request)):
        tokens[index] += delta.token_ids
    segments = await piece_segments(server.engine, pieces, tokens)
    if response_format == "verbose_json":
        task, language, duration, temperature = about
        return json_response(verbose_json(task, language, duration, segments, temperature))
    return Response((srt if response_format == "srt" else vtt)(segments), media_type="text/plain; charset=utf-8")


def _parsed(form: dict[str, Any], key: str, parse: Callable[[str], Any], what: str, default: Any = None) -> Any:
    """A form field read by ``parse`` (``default`` when left out or empty); a 400 naming it when it cannot be."""
    value = form.get(key)
    if value is None or value == "":
        return default
    try:
        return parse(value)
    except ValueError:
        raise InvalidRequestError(key, f"{what}, got {value!r}") from None


def _integer(text: str) -> int:
    """An int as pydantic's lax mode reads a string (vLLM's form fields): ``"3"``, ``" 3 "``, ``"3.0"`` (a zero
    fraction); not ``"3.5"``, ``"3."`` or ``"1e3"``."""
    whole, dot, fraction = text.strip().partition(".")
    return int(whole if dot and fraction and not fraction.strip("0") else text)


_TRUE = ("true", "1", "yes", "y", "on", "t")
_FALSE = ("false", "0", "no", "n", "off", "f")
"""The strings pydantic's lax mode reads as a bool (any case), as vLLM's form fields."""


def _flag(form: dict[str, Any], key: str) -> bool:
    value = str(form.get(key) or "false").lower()  # an empty field left out, as FastAPI's forms
    if value not in _TRUE + _FALSE:
        raise InvalidRequestError(key, f"true or false, got {value!r}")
    return value in _TRUE


async def _texts_in_order(request: Request, streams: list[RequestStream], firsts: list[Any] = (),
                          generated: list[int] | None = None, reasons: list[str] | None = None) -> AsyncIterator[str]:
    """The pieces' texts as they come, in the audio's order: a later piece's text waits for the earlier ones;
    `generated`'s one item counts the tokens of every piece, `reasons` gets each piece's finish reason."""
    held: list[list[str]] = [[] for _ in streams]
    finished = [False] * len(streams)
    current = 0
    async for index, delta in merge_streams(streams, firsts, until=lambda: wait_disconnect(request)):
        held[index].append(delta.text)
        if generated is not None:
            generated[0] += len(delta.token_ids)
        finished[index] = finished[index] or delta.finish_reason is not None
        if reasons is not None and delta.finish_reason is not None:
            reasons.append(delta.finish_reason)
        while current < len(streams) and (held[current] or finished[current]):
            text = "".join(held[current])
            held[current].clear()
            if text:
                yield text
            if not finished[current]:
                break
            current += 1


async def _events(request: Request, streams: list[RequestStream], firsts: list[Any], meta: dict[str, Any],
                  usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: each delta in OpenAI's and vLLM's shapes at once, the whole text, with `usage` vLLM's
    usage chunk (``stream_include_usage``), then ``[DONE]``."""
    parts: list[str] = []
    generated, reasons = [0], []
    try:
        async for text in _texts_in_order(request, streams, firsts, generated, reasons):
            parts.append(text)
            yield sse_event({**meta, "type": "transcript.text.delta", "delta": text,
                             "choices": [{"delta": {"content": text}, "finish_reason": None}]})
        yield sse_event({**meta, "type": "transcript.text.done", "text": "".join(parts),
                         "choices": [{"delta": {"content": ""}, "finish_reason": _finish_reason(reasons)}]})
        if usage:
            yield sse_event({**meta, "choices": [], "usage": _usage(streams, generated[0])})
    except ClientDisconnected:
        return
    except AsyncLLMError as exc:  # after the first event the status is sent: report in the stream
        yield sse_event(error_body(exc)[1])
    yield b"data: [DONE]\n\n"


def _finish_reason(reasons: list[str]) -> str:
    """The transcript's finish reason: ``length`` when a piece was cut by its token bound, else the reason of the
    piece that finished last (pieces run at once; every other reason is ``stop``)."""
    return "length" if "length" in reasons else (reasons[-1] if reasons else "stop")


def _usage(streams: list[RequestStream], generated: int) -> dict[str, int]:
    """vLLM's usage chunk: the decoder prompts' tokens (every piece's) and the generated ones."""
    prompt = sum(len(stream.collector.prompt_token_ids) for stream in streams if stream.collector is not None)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
