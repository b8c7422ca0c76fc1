"""Property: the speech-to-text routes (integrations/openai_audio.py) read their multipart form as vLLM's
``TranscriptionRequest`` / ``TranslationRequest`` do, with asyncllm's documented differences.

The reference (`_expected`) is written from vLLM's route (FastAPI reads the form into the pydantic model: every
value a string, pydantic's lax mode coercing it, a repeated field's last value, an empty field its default) and
docs/integrations/openai-server.md#speech-to-text: ``temperature`` a float (``"0.5"``, ``" 5e-1 "``; 0 to 100),
``seed`` / ``max_completion_tokens`` / ``priority`` ints (``"3"``, ``" 3 "``, ``"3.0"``; not ``"3.5"`` or
``"1e3"``; seed -1 is no seed, ``max_completion_tokens`` at least 1), ``stream`` / ``stream_include_usage`` bools
(``true``, ``yes``, ``on``, ``t``, ``1`` ... in any case), ``response_format`` one of json, text, verbose_json, srt,
vtt (srt and vtt asyncllm's, timed ones refused with ``stream``), ``timestamp_granularities[]`` ``segment`` with
verbose_json only (``word`` not built), any field asyncllm does not read (vLLM's ``top_p``, ``to_language``,
``hotwords`` ...) a 400 naming it. Coercion is pydantic's own (`TypeAdapter`), the lax mode vLLM's models use.

Drawn (``PROP_EXAMPLES`` draws more, at random): forms of a few fields, each sent once or twice, with values in
several spellings, junk and empty strings. The route runs on a stub speech engine (no model): `engine.stream`
records the params and priority, the streamed and whole answers are replaced by markers of which was chosen (and
with usage or not). Checked: accepted exactly when the reference accepts, with its params, priority, language, prompt
and answer kind; refused with `InvalidRequestError` naming a field the reference found bad.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace
from typing import Any
from unittest import mock

import httpx
import numpy as np
import pydantic
from asgi_helpers import http_scope
from drawn_fields import drawn_fields
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from asyncllm import InvalidRequestError
from asyncllm.integrations import openai_audio

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TIMED = ("verbose_json", "srt", "vtt")
GRANULARITY_KEYS = ("timestamp_granularities[]", "timestamp_granularities")
VLLM_ONLY = ("top_p", "top_k", "min_p", "frequency_penalty", "repetition_penalty", "presence_penalty", "to_language",
             "hotwords", "stream_continuous_usage_stats", "vllm_xargs", "n", "use_beam_search", "length_penalty")
LONG = 2**63
EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "400"))
_FLOAT, _INT, _BOOL = pydantic.TypeAdapter(float), pydantic.TypeAdapter(int), pydantic.TypeAdapter(bool)


# ---------------------------------------------------------------- the reference
class Bad(Exception):
    """The reference refuses: ``field`` is wrong."""

    def __init__(self, field: str) -> None:
        super().__init__(field)
        self.field = field


def _lax(adapter: pydantic.TypeAdapter, name: str, text: str) -> Any:
    try:
        return adapter.validate_python(text)
    except pydantic.ValidationError:
        raise Bad(name) from None


def _expected(form: dict[str, list[str]]) -> tuple[dict[str, Any] | None, set[str]]:
    """What vLLM (with asyncllm's documented differences) makes of the form: the read fields, or None and the names
    of every bad field."""
    values = {key: sent[-1] for key, sent in form.items() if key not in GRANULARITY_KEYS and sent[-1] != ""}
    bad: set[str] = {key for key in form if key in VLLM_ONLY}
    out: dict[str, Any] = {"language": values.get("language"), "prompt": values.get("prompt", "")}
    readers = {"response_format": _format, "temperature": _temperature, "seed": _seed,
               "max_completion_tokens": _max_tokens, "priority": _priority, "stream": _flag,
               "stream_include_usage": _flag}
    for name, read in readers.items():
        try:
            out[name] = read(name, values.get(name))
        except Bad as exc:
            bad.add(exc.field)
    granularities = [value for key in GRANULARITY_KEYS for value in form.get(key, [])]
    if any(value != "segment" for value in granularities):
        bad.add("timestamp_granularities")
    elif granularities and out.get("response_format", "verbose_json") != "verbose_json":
        bad.add("timestamp_granularities")
    if out.get("response_format") in TIMED and out.get("stream"):
        bad.add("stream")
    return (None, bad) if bad else (out, bad)


def _format(name: str, text: str | None) -> str:
    if text is not None and text not in FORMATS:
        raise Bad(name)
    return text or "json"


def _temperature(name: str, text: str | None) -> float:
    value = 0.0 if text is None else _lax(_FLOAT, name, text)
    if not 0.0 <= value <= 100.0:
        raise Bad(name)
    return value


def _seed(name: str, text: str | None) -> int | None:
    value = None if text is None else _lax(_INT, name, text)
    if value is not None and not -LONG <= value < LONG:
        raise Bad(name)
    return None if value == -1 else value


def _max_tokens(name: str, text: str | None) -> int | None:
    value = None if text is None else _lax(_INT, name, text)
    if value is not None and value < 1:
        raise Bad(name)
    return value


def _priority(name: str, text: str | None) -> int:
    return 0 if text is None else _lax(_INT, name, text)


def _flag(name: str, text: str | None) -> bool:
    return False if text is None else _lax(_BOOL, name, text)


# ---------------------------------------------------------------- the route on a stub engine
class Answered(Exception):
    """Raised where the route would answer: ``streamed`` (with ``usage``) or whole."""

    def __init__(self, streamed: bool, usage: bool | None = None) -> None:
        super().__init__(streamed, usage)
        self.streamed, self.usage = streamed, usage


class StubSpeech:
    sampling_rate = 16000
    timestamp_begin = 50364

    def __init__(self) -> None:
        self.prompts: list[tuple] = []

    def prompt(self, task: str, language: str | None, prompt: str | None, timestamps: bool) -> dict:
        self.prompts.append((task, language, prompt, timestamps))
        return {"prompt": "p"}

    def requests(self, prompt: dict, audio: Any) -> list[dict]:
        return [prompt]


class StubEngine:
    started = True

    def __init__(self) -> None:
        self.speech_to_text = StubSpeech()
        self.submitted: list[tuple] = []

    def stream(self, request: Any, params: Any, lora_request: Any = None, priority: int = 0) -> object:
        self.submitted.append((params, priority))
        return object()


async def _first_deltas(streams: list, until: Any = None) -> list:
    return []


def _streamed(request: Any, streams: list, firsts: list, meta: dict, usage: bool) -> None:
    raise Answered(True, usage)


def _whole(*args: Any, **kwargs: Any) -> None:
    raise Answered(False)


async def _timed(*args: Any, **kwargs: Any) -> None:
    raise Answered(False)


async def _audio(form: dict, rate: int) -> np.ndarray:
    return np.zeros(rate, dtype=np.float32)


def _request(form: dict[str, list[str]], route: str) -> Request:
    built = httpx.Request("POST", f"http://test/v1/audio/{route}", data=form,
                          files={"file": ("a.wav", b"RIFF....", "audio/wav")})
    body = built.read()
    sent = [False]

    async def receive() -> dict:
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(k.lower(), v) for k, v in built.headers.raw]
    return Request(http_scope("POST", built.url.path, headers=headers), receive)


def _run(form: dict[str, list[str]], route: str = "transcriptions") -> tuple[StubEngine, Any]:
    """The stub engine after the route read ``form``, and what ended it (`Answered` or `InvalidRequestError`)."""
    engine = StubEngine()
    server = SimpleNamespace(engine=engine, limits=SimpleNamespace(max_audio_bytes=1 << 16), request_log=None,
                             force_include_usage=False, _model=lambda name: (name or "m", None))
    task = "transcribe" if route == "transcriptions" else "translate"
    with mock.patch.multiple(openai_audio, _audio=_audio, first_deltas=_first_deltas, _events=_streamed,
                             _texts_in_order=_whole, _timed_response=_timed):
        try:
            asyncio.run(openai_audio._speech(server, _request(form, route), task))
        except (Answered, InvalidRequestError) as exc:
            return engine, exc
    raise AssertionError("the route answered without the stubs")  # pragma: no cover


# ---------------------------------------------------------------- drawn forms
def _spellings(numbers: st.SearchStrategy, render: list) -> st.SearchStrategy[str]:
    return st.builds(lambda n, f: f(n), numbers, st.sampled_from(render))


FLOAT_TEXT = [repr, "{:.3f}".format, "{:e}".format, " {} ".format, "+{}".format, lambda x: f"{x:.2f}".rstrip("0")]
INT_TEXT = [str, " {} ".format, " {}.0 ".format, "{}.0".format, "{}.000".format,
            lambda n: f"+{n}" if n >= 0 else str(n)]
INT_JUNK = ["{}.5".format, "{}e0".format, "{}.".format, "0x{}".format, "{},0".format]
TRUE_FALSE = ["true", "false", "1", "0", "yes", "no", "on", "off", "t", "f", "y", "n"]


def _cased(words: list[str]) -> st.SearchStrategy[str]:
    return st.builds(lambda w, upper: w.upper() if upper else w.capitalize(), st.sampled_from(words), st.booleans()) \
        | st.sampled_from(words)


def _sent(values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    """A field sent once or twice (the last counts)."""
    return st.lists(values, min_size=1, max_size=2)


VALID = {
    "temperature": _spellings(st.floats(0, 2, allow_subnormal=False), FLOAT_TEXT),
    "seed": _spellings(st.integers(-1, 2**40), INT_TEXT) | st.sampled_from([str(LONG - 1), str(-LONG)]),
    "max_completion_tokens": _spellings(st.integers(1, 500), INT_TEXT),
    "priority": _spellings(st.integers(-5, 5), INT_TEXT),
    "stream": _cased(TRUE_FALSE),
    "stream_include_usage": _cased(TRUE_FALSE),
    "response_format": st.sampled_from(FORMATS),
    "language": st.sampled_from(["en", "fr"]),
    "prompt": st.sampled_from(["hello", "earlier words"]),
    "model": st.just("m"),
}
JUNK = st.sampled_from(["", "abc", " ", "none", "null", "NaN-ish"])
WILD = {
    "temperature": VALID["temperature"] | _spellings(st.floats(-2, -0.01), FLOAT_TEXT) | JUNK
    | st.sampled_from(["1,5", "0x1", "1e3", "inf-"]),
    "seed": VALID["seed"] | _spellings(st.integers(-9, 9), INT_JUNK) | JUNK
    | st.sampled_from([str(LONG), str(-LONG - 1), "1e3"]),
    "max_completion_tokens": VALID["max_completion_tokens"] | _spellings(st.integers(-3, 0), INT_TEXT)
    | _spellings(st.integers(1, 9), INT_JUNK) | JUNK,
    "priority": VALID["priority"] | _spellings(st.integers(0, 9), INT_JUNK) | JUNK,
    "stream": VALID["stream"] | JUNK | st.sampled_from(["2", " true", "maybe", "True "]),
    "stream_include_usage": VALID["stream_include_usage"] | JUNK | st.sampled_from(["2", "enabled"]),
    "response_format": VALID["response_format"] | st.sampled_from(["", "JSON", "xml", " json"]),
    "language": VALID["language"] | st.just(""),
    "prompt": VALID["prompt"] | st.just(""),
    "model": st.sampled_from(["m", ""]),
}
GRANULARITIES = st.sampled_from(["segment", "word", "", "Segment", "words"])
READ_FORMS = drawn_fields({name: _sent(values) for name, values in WILD.items()},
                          {name: _sent(values) for name, values in VALID.items()}, 0, 5)


@st.composite
def _forms(draw: st.DrawFn) -> dict[str, list[str]]:
    """A form of the fields asyncllm reads (one draw in four with a response format and timestamp granularities, one
    in eight with a response format and ``stream``), one draw in twelve with a field of vLLM's that it does not."""
    form = draw(READ_FORMS)
    if draw(st.integers(0, 3)) == 3:  # half of them right: verbose_json and "segment"
        right = draw(st.booleans())
        form["response_format"] = ["verbose_json"] if right else [draw(st.sampled_from(FORMATS))]
        values = st.just("segment") if right else GRANULARITIES
        form[draw(st.sampled_from(GRANULARITY_KEYS))] = draw(st.lists(values, min_size=1, max_size=2))
    elif draw(st.integers(0, 5)) == 5:  # a format streamed, or not
        form["response_format"], form["stream"] = [draw(st.sampled_from(FORMATS))], [draw(VALID["stream"])]
    if draw(st.integers(0, 11)) == 11:
        form[draw(st.sampled_from(VLLM_ONLY))] = [draw(st.sampled_from(["0.5", "1", "fr", ""]))]
    return form


FORMS = _forms()


# ---------------------------------------------------------------- the property
def _check(form: dict[str, list[str]], route: str) -> None:
    expected, bad = _expected(form)
    engine, ended = _run(form, route)
    if isinstance(ended, InvalidRequestError):
        assert expected is None, f"refused a good form {form}: {ended}"
        assert ended.field in bad, f"{ended} names {ended.field!r}, expected one of {sorted(bad)}"
        assert not engine.submitted, "a refused form queued requests"
        return
    assert expected is not None, f"accepted a form with bad {sorted(bad)}: {form}"
    [(params, priority)] = engine.submitted
    assert (params.temperature, params.max_tokens, params.seed, priority) == (
        expected["temperature"], expected["max_completion_tokens"], expected["seed"], expected["priority"])
    task = "transcribe" if route == "transcriptions" else "translate"
    [(asked_task, language, prompt, timestamps)] = engine.speech_to_text.prompts
    assert (asked_task, language, prompt or "", timestamps) == (
        task, expected["language"], expected["prompt"], expected["response_format"] in TIMED)
    streamed = expected["stream"] and expected["response_format"] not in TIMED
    assert ended.streamed == streamed
    if streamed:
        assert ended.usage == expected["stream_include_usage"]


@given(FORMS, st.sampled_from(["transcriptions", "translations"]))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize="PROP_EXAMPLES" not in os.environ)  # fixed draws in CI; PROP_EXAMPLES: random
@example({"max_completion_tokens": ["5.0"]}, "transcriptions")
@example({"stream": ["yes"], "stream_include_usage": ["On"]}, "transcriptions")
@example({"stream": ["OFF"], "stream_include_usage": ["n"]}, "translations")
@example({"response_format": ["verbose_json"], "timestamp_granularities": ["Segment"]}, "transcriptions")
@example({"response_format": ["verbose_json"], "timestamp_granularities[]": ["segment", "word"]}, "translations")
def test_the_form_is_read_as_vllm_reads_it(form, route):
    _check(form, route)


# ---------------------------------------------------------------- plain examples of the bugs fixed
def test_an_integer_with_a_zero_fraction_is_an_integer_as_pydantic_reads_it():
    engine, ended = _run({"max_completion_tokens": ["16.0"], "seed": [" 7 "]})
    assert isinstance(ended, Answered)
    assert (engine.submitted[0][0].max_tokens, engine.submitted[0][0].seed) == (16, 7)


def test_pydantic_bool_spellings_stream():
    engine, ended = _run({"stream": ["yes"], "stream_include_usage": ["on"]})
    assert isinstance(ended, Answered) and ended.streamed and ended.usage


def test_empty_stream_and_response_format_fields_take_their_defaults():
    engine, ended = _run({"stream": [""], "response_format": [""], "stream_include_usage": [""]})
    assert isinstance(ended, Answered) and not ended.streamed and engine.submitted


def test_a_bad_stream_value_is_refused_before_anything_is_queued():
    engine, ended = _run({"stream": ["maybe"]})
    assert isinstance(ended, InvalidRequestError) and ended.field == "stream"
    assert not engine.submitted
