"""Pieces of tool calls as a reply streams; a call's JSON object read as it comes; the ``hermes`` stream.

A `ToolCallDeltaStream` turns a reply's text deltas into its content and `ToolCallDelta`s, in the reply's order.
`CallObject` reads one call's JSON object with a `JsonObjectScanner` (json_stream.py): the call's first piece (its
id and name) goes out once its name is read, and its arguments as json.dumps writes them, piece by piece as they
are read (``stream_arguments``), or the call whole once it is one. `HermesStream` reads ``<tool_call>`` blocks
with it, tool_call_llama3.py's `Llama3JsonStream` the call objects anywhere in a reply; tool_call_replies.py the
formats whose reply ends in calls; tool_calls.py holds the parsers that make these streams.
"""

from __future__ import annotations

import abc
import json
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from asyncllm.json_stream import JsonObjectScanner

__all__ = ["ToolCallDelta", "ReplyPart", "ToolCallDeltaStream", "CallObject", "TaggedBlockStream", "HermesStream",
           "tool_call_id", "mistral_tool_call_id", "partial_tag_suffix"]


def tool_call_id() -> str:
    """A fresh id for one call (``call_`` and 24 hex digits, as OpenAI's)."""
    return "call_" + uuid.uuid4().hex[:24]


def mistral_tool_call_id() -> str:
    """A fresh id for one Mistral call: 9 letters and digits, as vLLM's ``MistralToolCall`` (Mistral's chat
    templates refuse any other id in the next turn's history)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass
class ToolCallDelta:
    """A piece of one call, as a stream reads it.

    A call's first piece has its `id` and `name`; its pieces' `arguments`,
    joined, are its arguments text; its last piece has `done` when the call
    turned out whole (a call that started streaming and then broke never gets
    one: its text comes as content too).
    """

    index: int
    """The call's number among this reply's calls, from 0."""
    arguments: str = ""
    name: str | None = None
    id: str | None = None
    done: bool = False


ReplyPart = str | ToolCallDelta
"""A piece of a reply: content text, or a piece of a call."""


class ToolCallDeltaStream(abc.ABC):
    """One reply's text deltas in; its content and `ToolCallDelta`s out, in the reply's order (`ToolParser.delta_stream`)."""

    @abc.abstractmethod
    def feed(self, text: str) -> list[ReplyPart]:
        """The content and call pieces this delta releases."""

    @abc.abstractmethod
    def finish(self) -> list[ReplyPart]:
        """At the reply's end: whatever was held back (an unfinished call's text is content)."""

    def end_message(self) -> list[ReplyPart]:
        """A harmony message of the reply ended (the Responses API's item ends): what this stream held back of its
        text, so it is not carried into the next message's (`HarmonyToolStream`'s; other formats hold none)."""
        return []


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the next delta may complete it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class CallObject:
    """One call's JSON object, ``{"name": ..., <an arguments key>: {...}}``, read as its text comes.

    Its arguments text is what `call_from_value` makes of the whole object
    (json_stream.py writes json.dumps's text as it reads); with
    `stream_arguments` its pieces are reported as they are read. Arguments written as ``null`` make a call whose
    arguments are ``null`` (vLLM's ``json.dumps(call["arguments"])``), sent whole at the object's end.
    """

    def __init__(self, index: int, arguments_keys: tuple[str, ...], stream_arguments: bool,
                 new_id: Callable[[], str] = tool_call_id, serialized: bool = False,
                 arguments_required: bool = False) -> None:
        """`serialized`: arguments written as a JSON string holding an object (Granite 4's) are that object (as
        vLLM's ``hermes``); `arguments_required`: an object without an arguments key is no call (``llama3_json``)."""
        self.json = JsonObjectScanner()
        self._serialized, self._required = serialized, arguments_required
        self.index = index
        self.id = new_id()
        self._keys = arguments_keys
        self._stream = stream_arguments
        self.started = False
        """Its first piece is out (streaming only): it stays, whatever follows."""
        self._sent: list[str] = []  # the arguments' pieces sent

    def feed(self, text: str) -> tuple[int, list[ToolCallDelta]]:
        """How many of `text`'s characters belong to the object, and the pieces they release (the same however
        the text is cut: what was read before an error counts)."""
        used = self.json.feed(text)
        name = self._first_name() if self._stream else None
        if name is None:
            return used, []
        deltas = [] if self.started else [self._start(name)]
        key = self._arguments_key()
        pieces = self._first(key) if key is not None else None
        if pieces and pieces[0] == "{":
            new = "".join(pieces[len(self._sent):])
            self._sent += pieces[len(self._sent):]
            if new:
                deltas.append(ToolCallDelta(self.index, new))
        return used, deltas

    def close(self) -> list[ToolCallDelta] | None:
        """The call's last pieces once its object has ended; None when it is not a whole call (its text is content)."""
        key = self._arguments_key()
        if key is None and self._required:
            return None
        arguments = self.json.value(key) if key is not None else "{}"
        if self._serialized and arguments.startswith('"'):
            arguments = _serialized_object(arguments)
        text = self.json.value("name") if self.json.done else ""
        if not text.startswith('"') or not (arguments.startswith("{") or arguments == "null"):
            return None  # arguments null: a call with arguments "null", as vLLM's json.dumps of the value
        if not self._stream:
            return [ToolCallDelta(self.index, arguments, json.loads(text), self.id, done=True)]
        if self.json.repeated & {"name", *self._keys} or sum(k in self.json.values for k in self._keys) > 1:
            return None  # streamed: the first copy was sent, so a second one cannot be the call's
        deltas = [] if self.started else [self._start(json.loads(text))]
        return deltas + [ToolCallDelta(self.index, arguments[len("".join(self._sent)):], done=True)]

    def _start(self, name: str) -> ToolCallDelta:
        self.started = True
        return ToolCallDelta(self.index, "", name, self.id)

    def _first(self, key: str) -> list[str] | None:
        """The pieces of `key`'s first value (a repeated key's later copies are not streamed)."""
        return self.json.first_values.get(key, self.json.values.get(key))

    def _first_name(self) -> str | None:
        pieces = self._first("name")
        finished = "name" in self.json.first_values or "name" in self.json.finished
        text = "".join(pieces) if pieces and finished else ""
        return json.loads(text) if text.startswith('"') else None

    def _arguments_key(self) -> str | None:
        return next((key for key in self._keys if key in self.json.values), None)


def _serialized_object(text: str) -> str:
    """A JSON string's text holding a JSON object: that object as json.dumps writes it (else `text`)."""
    try:
        value = json.loads(json.loads(text))
    except (ValueError, RecursionError):
        return text
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else text


class TaggedBlockStream(ToolCallDeltaStream):
    """Calls in ``<tool_call>`` blocks, content between them: the block text is read up to its first
    ``</tool_call>`` (held back while the text may be that tag's start, so none of it reaches a call) and a block
    that is not a call is content. A subclass reads a block's text (`_feed_block`) and closes it (`_close_block`).

    With `LAST_CLOSE_OPTIONAL` (vLLM's ``hermes`` and ``qwen3_coder`` regexes), a block still open at the reply's
    end is closed there: a call if its text is one whole call, else content (without the closing tag it lacks)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    LAST_CLOSE_OPTIONAL = False

    def __init__(self) -> None:
        self._buffer = ""
        self._in_block = False
        self._unclosed = False  # the open block is closed by the reply's end, not by its tag
        self._block: list[str] = []  # the open block's text (its content if it is not a call)
        self._index = 0  # the next call's index
        self._calls = 0  # whole calls read
        self._space = ""  # whitespace after a call, held until more content shows it is inside the content
        self._after_call = False  # a call's piece came: whitespace from here on is held
        self._before_open = ""  # the whitespace dropped at a call's first piece, while it is not done: content if
        # the call breaks (its text is content then, and so is the whitespace before it, as in the whole reply)

    def feed(self, text: str) -> list[ReplyPart]:
        self._buffer += text
        parts: list[ReplyPart] = []
        while self._read_block(parts) if self._in_block else self._read_content(parts):
            pass
        return self._spacing(parts)

    def finish(self) -> list[ReplyPart]:
        parts: list[ReplyPart] = []
        if self._in_block and self.LAST_CLOSE_OPTIONAL:
            rest, self._buffer = self._buffer, ""
            self._block.append(rest)
            parts += self._feed_block(rest)
            self._in_block, self._unclosed = False, True
            parts += self._close_block()
        rest = self._buffer
        if self._in_block:
            rest = self.OPEN + "".join(self._block) + rest
        self._buffer, self._in_block, self._block = "", False, []
        return self._spacing(parts + [rest])

    @abc.abstractmethod
    def _open_block(self) -> None:
        """A block opened: start reading a call."""

    @abc.abstractmethod
    def _feed_block(self, text: str) -> list[ReplyPart]:
        """More of the open block's text; the call pieces it releases."""

    @abc.abstractmethod
    def _close_block(self) -> list[ReplyPart]:
        """The block closed: its call's last pieces, or its text as content (`_as_content`)."""

    def _as_content(self) -> list[ReplyPart]:
        return [self.OPEN + "".join(self._block) + ("" if self._unclosed else self.CLOSE)]

    def _read_content(self, parts: list[ReplyPart]) -> bool:
        """Content up to the next block's start; True when a block opened."""
        start = self._buffer.find(self.OPEN)
        if start < 0:
            end = len(self._buffer) - partial_tag_suffix(self._buffer, self.OPEN)
            parts.append(self._buffer[:end])
            self._buffer = self._buffer[end:]
            return False
        parts.append(self._buffer[:start])
        self._buffer = self._buffer[start + len(self.OPEN):]
        self._in_block, self._block = True, []
        self._open_block()
        return True

    def _read_block(self, parts: list[ReplyPart]) -> bool:
        """The open block's text up to its closing tag (or what cannot begin it); True when the block closed."""
        end = self._buffer.find(self.CLOSE)
        size = end if end >= 0 else len(self._buffer) - partial_tag_suffix(self._buffer, self.CLOSE)
        text, self._buffer = self._buffer[:size], self._buffer[size:]
        self._block.append(text)
        parts += self._feed_block(text)
        if end < 0:
            return False
        self._buffer = self._buffer[len(self.CLOSE):]
        self._in_block = False
        parts += self._close_block()
        return True

    def _spacing(self, parts: list[ReplyPart]) -> list[ReplyPart]:
        """Text between calls that is only whitespace (the newlines around blocks) is not content: after a call,
        whitespace is held back until more content follows it (then it is content, as in the whole reply) and
        dropped if a call or the end follows, part by part in order, so however the reply was cut into pieces;
        once content followed the call, whitespace is content as it comes. A streamed call that breaks after its
        first piece is content as well (its text follows its pieces): the whitespace before it is content then."""
        out: list[ReplyPart] = []
        for part in parts:
            if not isinstance(part, str):
                if part.name is not None:
                    self._before_open = self._space
                if part.done:
                    self._before_open = ""
                self._space, self._after_call = "", True
                out.append(part)
            elif self._after_call and not part.strip():
                self._space += part
            elif part:
                out.append(self._before_open + self._space + part)
                self._space, self._before_open, self._after_call = "", "", False
        return out


class HermesStream(TaggedBlockStream):
    """``<tool_call>`` blocks each holding one call's JSON object (the last one's ``</tool_call>`` optional)."""

    LAST_CLOSE_OPTIONAL = True

    def __init__(self, stream_arguments: bool) -> None:
        super().__init__()
        self._stream_arguments = stream_arguments
        self._call: CallObject | None = None  # the open block's call
        self._after_object = ""  # the open block's text after its object: whitespace, or it is not a call

    def _open_block(self) -> None:
        self._call = CallObject(self._index, ("arguments",), self._stream_arguments, serialized=True)
        self._after_object = ""

    def _feed_block(self, text: str) -> list[ReplyPart]:
        assert self._call is not None
        used, deltas = self._call.feed(text)
        self._after_object += text[used:]
        return list(deltas)

    def _close_block(self) -> list[ReplyPart]:
        assert self._call is not None
        call, self._call = self._call, None
        deltas = call.close() if not self._after_object.strip() else None
        if deltas is not None or call.started:
            self._index = call.index + 1
        if deltas is None:  # not a call after all: its text is content (a call that started streaming stays)
            return self._as_content()
        self._calls += 1
        return list(deltas)
