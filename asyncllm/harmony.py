"""gpt-oss's harmony format: a reply's messages read as they stream (the ``openai_gptoss`` and ``openai`` parsers).

A gpt-oss reply is a sequence of messages (openai/harmony)::

    <|channel|>analysis<|message|>…thinking…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>…answer…<|return|>

Its first message has no ``<|start|>assistant`` (the chat template's
generation prompt wrote it). A header names the channel (``analysis``:
thinking; ``final``: the answer; ``commentary``: tool calls, or without a
recipient a preamble shown to the user) and maybe a recipient, ``to=...``,
in its role part or after its channel. ``<|end|>`` ends a message,
``<|return|>`` and ``<|call|>`` end the reply (the model's EOS ids).

`HarmonyScanner` turns text deltas into events however the text is cut
(markers split anywhere are held back, only as long as they may be one):
text outside any message, a message's header, its body's pieces, its end.
What does not read as harmony (a header broken by an end marker, a reply
without markers) is text outside messages, passed on as it is: nothing the
model wrote is lost. `HarmonyReasoningStream` (``openai_gptoss``) and
`HarmonyToolStream` (``openai``) are the two readings of these events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from asyncllm.tool_call_replies import ArgumentsObject
from asyncllm.tool_call_streams import ReplyPart, ToolCallDelta, ToolCallDeltaStream, partial_tag_suffix

__all__ = ["Header", "HarmonyScanner", "HarmonyReasoningStream", "HarmonyToolStream", "FINAL_START", "MessagePart",
           "joined_parts", "parse_header"]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
FINAL_START = CHANNEL + "final" + MESSAGE
"""The final channel's header with nothing between: a constraint starts after `GptOssReasoningParser`'s end_tag and
end_suffix, which allow tokens between (``<|constrain|>json``)."""
_ENDS = (END, RETURN, CALL)
_LONGEST_MARKER = max(len(marker) for marker in (START, MESSAGE, *_ENDS))
_FIRST_OPENERS = (CHANNEL, " to=")
"""What may open the reply's first message, whose ``<|start|>assistant`` is in the prompt."""
_FUNCTIONS = "functions."


@dataclass(frozen=True)
class Header:
    """A message's header: its text as written (from ``<|start|>`` when it has one, through ``<|message|>``)."""

    text: str
    channel: str | None
    recipient: str | None


def parse_header(text: str) -> Header:
    """The channel and recipient of a header's text (`Header.text`)."""
    inner = text.removeprefix(START).removesuffix(MESSAGE)
    role_part, has_channel, channel_part = inner.partition(CHANNEL)
    channel_words = channel_part.replace(CONSTRAIN, " " + CONSTRAIN).split()
    recipient = next((w[3:] for w in role_part.split() + channel_words if w.startswith("to=")), None)
    channel = channel_words[0] if has_channel and channel_words and not channel_words[0].startswith("to=") else None
    return Header(text, channel, recipient)


Event = tuple[str, "str | Header"]
"""("text", outside any message), ("open", Header), ("body", a piece of it), ("close", its end marker or "")."""


class HarmonyScanner:
    """A reply's text deltas in, harmony events out (the same events, joined, however the text is cut)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "first"  # first (the reply's start), outside, header, body
        self._searched = 0  # in a header: where the next search for a marker starts (the text before holds none)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """At the reply's end: what was held back (an unfinished header is text; an unfinished body ends)."""
        rest, self._buffer = self._buffer, ""
        if self._state == "body":
            return ([("body", rest)] if rest else []) + [("close", "")]
        return [("text", rest)] if rest else []

    def release(self) -> list[Event]:
        """Outside messages: the text held back as a marker's possible start, as text (its reader knows a message
        ended there, so it was that message's). Inside a header or a body: nothing (still held)."""
        if self._state not in ("first", "outside") or not self._buffer:
            return []
        rest, self._buffer, self._state = self._buffer, "", "outside"
        return [("text", rest)]

    def _step(self, events: list[Event]) -> bool:
        """Read what the state allows; True when it changed state (read on)."""
        if self._state == "first":
            return self._first()
        if self._state == "outside":
            return self._outside(events)
        if self._state == "header":
            return self._read_header(events)
        return self._body(events)

    def _first(self) -> bool:
        if any(opener.startswith(self._buffer) for opener in _FIRST_OPENERS):
            return False  # "" or an opener's first characters: wait
        self._state = "header" if self._buffer.startswith(_FIRST_OPENERS) else "outside"
        return True

    def _outside(self, events: list[Event]) -> bool:
        start = self._buffer.find(START)
        end = start if start >= 0 else len(self._buffer) - partial_tag_suffix(self._buffer, START)
        if end:
            events.append(("text", self._buffer[:end]))
        self._buffer = self._buffer[end:]
        if start < 0:
            return False
        self._state = "header"  # the buffer holds the header's text from its <|start|>
        return True

    def _read_header(self, events: list[Event]) -> bool:
        """The header up to ``<|message|>``; a ``<|start|>`` or an end marker before it: not a header (text)."""
        skip = len(START) if self._buffer.startswith(START) else 0
        marker, pos = _earliest(self._buffer, (MESSAGE, START, *_ENDS), max(skip, self._searched))
        if marker is None:  # the next search starts where a marker may still end in the next text: linear time
            self._searched = max(0, len(self._buffer) - _LONGEST_MARKER + 1)
            return False
        self._searched = 0
        if marker == START:  # a new message begins: the broken header was text
            events.append(("text", self._buffer[:pos]))
            self._buffer = self._buffer[pos:]
            return True
        text, self._buffer = self._buffer[:pos + len(marker)], self._buffer[pos + len(marker):]
        events.append(("open", parse_header(text)) if marker == MESSAGE else ("text", text))
        self._state = "body" if marker == MESSAGE else "outside"
        return True

    def _body(self, events: list[Event]) -> bool:
        """The body up to its end marker (a ``<|start|>`` without one also ends it, and opens the next)."""
        marker, pos = _earliest(self._buffer, (*_ENDS, START))
        end = pos if marker is not None else len(self._buffer) - max(
            partial_tag_suffix(self._buffer, tag) for tag in (*_ENDS, START))
        if end:
            events.append(("body", self._buffer[:end]))
        self._buffer = self._buffer[end:]
        if marker is None:
            return False
        events.append(("close", "" if marker == START else marker))
        self._state = "outside"
        if marker != START:
            self._buffer = self._buffer[len(marker):]
        return True


def _earliest(text: str, markers: tuple[str, ...], skip: int = 0) -> tuple[str | None, int]:
    """The marker found first in `text` from `skip` on, and its position ((None, -1) if none)."""
    found = [(pos, marker) for marker in markers if (pos := text.find(marker, skip)) >= 0]
    if not found:
        return None, -1
    pos, marker = min(found)
    return marker, pos


MessagePart = tuple[str, str, bool]
"""A reply's piece, in order: its kind, its text, whether it starts a harmony message. The kind: ``reasoning``
(analysis), ``content`` (final, preamble) or ``raw`` (passed on as written: text outside messages, a message with a
recipient)."""


def joined_parts(reasoning: str, content: str) -> list[MessagePart]:
    """A reply's reasoning and content, each joined, as its parts (neither starts a message)."""
    return [(kind, text, False) for kind, text in (("reasoning", reasoning), ("content", content)) if text]


class HarmonyReasoningStream:
    """``openai_gptoss``: analysis bodies are reasoning; final and preamble (commentary without a recipient) bodies
    content; a message with a recipient (a tool call) passes on as written, as content, for a tool-call parser
    after this one to read (without one it stays content); text outside messages is content.

    `feed` and `finish` join each kind's messages with a newline (a chat message's reasoning and content);
    `feed_parts` and `finish_parts`, `apart`, keep the messages apart, in order (the Responses API's items, one a
    message), else give the joined text as parts (a tag parser's `ReasoningStream.feed_parts`)."""

    def __init__(self, apart: bool = False) -> None:
        self._apart = apart
        self._scanner = HarmonyScanner()
        self._kind = ""  # the open message's: reasoning, content, or raw
        self._starts = False  # the open message's first part is still to come
        self._said = {"reasoning": False, "content": False}  # whether that kind has had a body (a newline joins)

    def feed(self, text: str) -> tuple[str, str]:
        return self._joined(self._parts(self._scanner.feed(text)))

    def finish(self) -> tuple[str, str]:
        return self._joined(self._parts(self._scanner.finish()))

    def feed_parts(self, text: str) -> list[MessagePart]:
        return self._parts(self._scanner.feed(text)) if self._apart else joined_parts(*self.feed(text))

    def finish_parts(self) -> list[MessagePart]:
        return self._parts(self._scanner.finish()) if self._apart else joined_parts(*self.finish())

    def _joined(self, parts: list[MessagePart]) -> tuple[str, str]:
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        for kind, text, starts in parts:
            if kind == "raw":
                out["content"].append(text)
                continue
            if starts and self._said[kind]:
                out[kind].append("\n")  # the next message of the same kind: a line of its own
            self._said[kind] = True
            out[kind].append(text)
        return "".join(out["reasoning"]), "".join(out["content"])

    def _parts(self, events: list[Event]) -> list[MessagePart]:
        parts: list[MessagePart] = []
        for kind, value in events:
            if isinstance(value, Header):
                self._starts = True
                self._kind = "raw" if value.recipient is not None else \
                    "reasoning" if value.channel == "analysis" else "content"
                if self._kind == "raw":
                    parts.append(("raw", value.text, self._take_start()))
            elif value and (kind == "text" or self._kind == "raw"):
                parts.append(("raw", value, False))  # outside messages, or a message passed on as written
            elif value and kind == "body":
                parts.append((self._kind, value, self._take_start()))
        return parts

    def _take_start(self) -> bool:
        starts, self._starts = self._starts, False
        return starts


class HarmonyToolStream(ToolCallDeltaStream):
    """``openai``: a message addressed to ``functions.NAME`` whose body is a JSON object is a call (its body the
    arguments, streamed through the JSON scanner); so is one ended by an end marker whose body does not start with
    ``{`` (its arguments, in one piece at its end, the body's JSON as json.dumps writes it, or the body as written
    when it is no JSON: vLLM's); everything else is content as written (after ``openai_gptoss`` that is the
    answer's text, and the messages with other recipients)."""

    def __init__(self, stream_arguments: bool) -> None:
        self._scanner = HarmonyScanner()
        self._stream_arguments = stream_arguments
        self._call: ArgumentsObject | None = None  # the open message's call
        self._raw: list[str] = []  # the open call message's text (content if it is not a call)
        self._after = ""  # its body's text after the JSON object (whitespace, or it is not a call)
        self._index = 0

    def feed(self, text: str) -> list[ReplyPart]:
        return self._parts(self._scanner.feed(text))

    def finish(self) -> list[ReplyPart]:
        return self._parts(self._scanner.finish())

    def end_message(self) -> list[ReplyPart]:
        """A harmony message whose text this stream read ended (the Responses API's item ends): what it held back
        of that text (a trailing ``<``), so it is not carried into the next message's text."""
        return self._parts(self._scanner.release())

    def _parts(self, events: list[Event]) -> list[ReplyPart]:
        parts: list[ReplyPart] = []
        for kind, value in events:
            if isinstance(value, Header):
                parts += self._open(value)
            elif self._call is None:
                parts.append(value)  # text, or a message not addressed to a function: as written
            elif kind == "body":
                parts += self._call_body(value)
            else:
                parts += self._close(value)
        return [p for p in parts if p != ""]

    def _open(self, header: Header) -> list[ReplyPart]:
        name = (header.recipient or "").removeprefix(_FUNCTIONS)
        if not (header.recipient or "").startswith(_FUNCTIONS) or not name:
            return [header.text]
        self._call = ArgumentsObject(self._index, name, self._stream_arguments)
        self._raw, self._after = [header.text], ""
        return list(self._call.first())

    def _call_body(self, text: str) -> list[ReplyPart]:
        assert self._call is not None
        self._raw.append(text)
        if self._call.json.done or self._call.json.error:
            self._after += text
            return []
        used, deltas = self._call.feed(text)
        self._after += text[used:]
        return list(deltas)

    def _close(self, marker: str) -> list[ReplyPart]:
        """The call's last piece; a message whose body starts with ``{`` but is not one JSON object (or whose body
        did not start with one and no end marker ended it) is content (a call that started streaming stays as it
        was sent)."""
        assert self._call is not None
        call, self._call = self._call, None
        deltas = call.close() if not call.json.error and not self._after.strip() else None
        if deltas is None and marker and call.json.error and not call.json.text:
            deltas = self._raw_call(call)
        if deltas is not None or self._stream_arguments:  # streamed, its first piece was sent at its header
            self._index = call.index + 1
        if deltas is None:
            return ["".join(self._raw) + marker]
        return list(deltas)

    def _raw_call(self, call: ArgumentsObject) -> list[ReplyPart]:
        """A body that does not start with ``{`` (none of it was streamed): vLLM's arguments for it,
        ``json.dumps(json.loads(body))``, or the body as written when it is no JSON."""
        body = "".join(self._raw[1:])
        try:
            arguments = json.dumps(json.loads(body), ensure_ascii=False)
        except (ValueError, RecursionError):
            arguments = body
        if self._stream_arguments:  # its first piece went out at its header
            return [ToolCallDelta(call.index, arguments, done=True)]
        return [ToolCallDelta(call.index, arguments, call.name, call.id, done=True)]
