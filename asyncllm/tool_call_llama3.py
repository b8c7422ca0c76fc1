"""The ``llama3_json`` stream: each call object of a reply read wherever it is (`CallObject`, tool_call_streams.py)."""

from __future__ import annotations

from asyncllm.tool_call_streams import CallObject, ReplyPart, ToolCallDeltaStream, partial_tag_suffix

__all__ = ["Llama3JsonStream", "PYTHON_TAG"]

PYTHON_TAG = "<|python_tag|>"

_RETRY_FACTOR, _RETRY_FLOOR = 16, 65_536
"""The characters read again for the ``{`` after each object that broke (or that the reply's end cut off), at most
this many times the text's length (plus the floor): each retry of deeply nested objects reads them again up to the
break (a reply cut inside ``{"a": {"b": ...`` 3,000 deep took seconds on the event loop, and one that broke
mid-reply, ``{"a": {"a": ... x``, 15 s); past it an object that breaks is text, the ``{`` inside it not tried. A
call starts at most that many characters into an object that broke."""


class Llama3JsonStream(ToolCallDeltaStream):
    """``llama3_json``: each JSON object of the reply that is ``{"name", "parameters" (or "arguments")}`` is a
    call, wherever it is (a ``{`` that starts no JSON value is text, and the next one is tried; an object that is
    no call is text, braces inside it included: vLLM's open PR 49923's reading). Each call is whole (`done`) once its
    object closes. A reply with calls has no content, as vLLM's: a whole reply's text (no `stream_arguments`) is
    held to its end, content only if no call came; streamed, the text before the first call goes out as it comes,
    and the text after it is dropped. A leading ``<|python_tag|>``, ``;`` and whitespace are held back: dropped
    when a call follows them, content (tag included, as vLLM's whole-reply content keeps it) when text does."""

    SEPARATORS = " \t\r\n;"

    def __init__(self, stream_arguments: bool) -> None:
        self._stream_arguments = stream_arguments
        self._held: list[str] = []  # a whole reply's content, until its end shows whether it has calls
        self._buffer = ""  # text not read yet
        self._call: CallObject | None = None  # the open object
        self._object: list[str] = []  # its text
        self._index = 0  # the next call's index
        self._calls = 0  # whole calls read
        self._space: str | None = ""  # separators held before any content (None: content came)
        self._budget = _RETRY_FLOOR  # characters that may yet be read again (`_RETRY_FACTOR`)

    def feed(self, text: str) -> list[ReplyPart]:
        self._buffer += text
        self._budget += _RETRY_FACTOR * len(text)
        parts: list[ReplyPart] = []
        while self._read_object(parts) if self._call is not None else self._read_text(parts):
            pass
        return self._released(parts)

    def finish(self) -> list[ReplyPart]:
        parts: list[ReplyPart] = []
        while self._call is not None:  # an object the reply's end cut off is text: the next "{" is tried
            self._not_json(parts)
            while self._read_object(parts) if self._call is not None else self._read_text(parts):
                pass
        self._content(parts, self._buffer)
        self._buffer = ""
        if self._space and not self._calls:  # a reply without calls: all of it is content
            parts.append(self._space)
        return self._released(parts, end=True)

    def _released(self, parts: list[ReplyPart], end: bool = False) -> list[ReplyPart]:
        """`parts`, a whole reply's content held back to its end (then content only if no call came)."""
        if not self._stream_arguments:
            self._held += [p for p in parts if isinstance(p, str)]
            parts = [p for p in parts if not isinstance(p, str)]
        return self._held + parts if end and not self._calls else parts

    def _read_text(self, parts: list[ReplyPart]) -> bool:
        """Content up to the next ``{`` (held back while the text may end in ``<|python_tag|>``'s start)."""
        start = self._buffer.find("{")
        end = start if start >= 0 else len(self._buffer) - partial_tag_suffix(self._buffer, PYTHON_TAG)
        self._content(parts, self._buffer[:end])
        self._buffer = self._buffer[end:]
        if start >= 0:
            self._call = CallObject(self._index, ("arguments", "parameters"), self._stream_arguments,
                                    arguments_required=True)
            self._object = []
        return start >= 0

    def _read_object(self, parts: list[ReplyPart]) -> bool:
        assert self._call is not None
        used, deltas = self._call.feed(self._buffer)
        parts += deltas
        self._object.append(self._buffer[:used])
        self._buffer = self._buffer[used:]
        if self._call.json.error:
            self._not_json(parts)
            return True
        if not self._call.json.done:
            return False
        call, self._call = self._call, None
        ends = call.close()
        self._index = call.index + 1 if ends is not None or call.started else self._index
        if ends is None:  # a JSON object that is no call: text (a call that started streaming stays)
            self._content(parts, "".join(self._object))
        else:
            parts += ends
            self._calls += 1  # the separators held before it are dropped, as all text after it
        return True

    def _not_json(self, parts: list[ReplyPart]) -> None:
        """The open object's ``{`` starts no JSON value: it is text, and what follows it is read again (past the
        bound, `_RETRY_FACTOR`, all of the object's text read so far is text)."""
        assert self._call is not None
        if self._call.started:
            self._index = self._call.index + 1
        read = "".join(self._object)
        self._budget -= len(read)
        if self._budget < 0:
            self._content(parts, read)
        else:
            self._buffer = read[1:] + self._buffer
            self._content(parts, "{")
        self._call, self._object = None, []

    def _content(self, parts: list[ReplyPart], text: str) -> None:
        if self._calls:  # text after a call is not content
            return
        if self._space is not None:
            rest = text.lstrip(self.SEPARATORS)
            while rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG):].lstrip(self.SEPARATORS)
            self._space += text[:len(text) - len(rest)]
            if not rest:
                return
            text, self._space = self._space + rest, None
        if text:
            parts.append(text)
