"""One chat choice's reply as OpenAI deltas: reasoning, content and tool calls.

`ChatReply` takes the reply's text deltas and returns OpenAI chat deltas:
``{"reasoning": ...}`` (with a reasoning parser, the thoughts before
``</think>``), ``{"content": ...}`` and ``{"tool_calls": [...]}`` items (under
a `ToolMode`, the answer after the thoughts). A non-streaming message is
`merge_deltas` of the deltas of the whole text (``stream_arguments`` false), so
both forms agree. Streaming, a named call's arguments flow as the tokens
come, and so do an ``auto`` call's once its name is read (``pythonic`` calls
come whole, at the reply's end); ``required`` calls are sent whole at the
reply's end (one cut short: those written whole, the unfinished one's text as
content). The one way the forms differ: an ``auto`` call that breaks
after its first piece (its JSON stops being JSON, the reply is cut short, or a
``llama3_json``/``mistral`` reply turns out not to be all calls) stays in the
stream as it was sent, while the whole reply has only its text, as content
(both have the text; with ``parallel_tool_calls`` false it does not hold the
one place, which the next whole call takes in both forms); and a ``llama3_json``
reply's text before its first call goes out as content, where the whole reply
with calls has none (as vLLM's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from asyncllm.integrations.openai_tools import ToolMode
from asyncllm.reasoning import ReasoningParser
from asyncllm.tool_calls import ReplyPart, ToolCall, ToolCallDelta, ToolCallDeltaStream, call_from_value

__all__ = ["ChatReply", "merge_deltas"]

Delta = dict[str, Any]

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class ChatReply:
    """One choice's reply: text deltas in, OpenAI chat deltas out."""

    def __init__(self, mode: ToolMode, reasoning: ReasoningParser | None = None, stream_arguments: bool = True,
                 prompt_ended_thinking: bool = False, message_starts: bool = False,
                 prompt_opened_thinking: bool = False) -> None:
        """With `reasoning`, a constraint (a named or required tool choice's) applies after the thinking
        (`StructuredOutputs.start_after`, set by the server): the thoughts come first in any mode.
        `prompt_ended_thinking`: the prompt's end closed the thinking (`Marker.starts_answer`): all of the reply
        is the answer, and a constraint applies from its start. `prompt_opened_thinking`: the prompt's end opened it
        (`Marker.opened_by`): the reply thinks until the parser's end tag, as its constraint waits for it.

        `stream_arguments` (a streamed reply): an ``auto`` call's arguments come
        in pieces as they are generated; a call that breaks after its first
        piece stays as sent (its text comes as content too). False (a whole
        reply): each call comes whole once it is one, and a broken one is content
        only (`ToolParser.delta_stream`).

        `message_starts` (the Responses API's): a harmony reply's messages come apart, in order, each after a
        ``{"message_start": True}`` delta and without the newline that joins a chat message's.
        """
        self.mode = mode
        self._reasoning = reasoning.stream(prompt_ended_thinking, message_starts, prompt_opened_thinking) \
            if reasoning is not None else None
        self._calls_stream: ToolCallDeltaStream | None = (
            mode.parser.delta_stream(stream_arguments) if mode.parser is not None else None)
        self._text: list[str] = []
        self._calls = 0
        self._indexes: dict[int, int | None] = {}
        """An auto call's index in the parser's stream -> its index in the reply (None: left out, not parallel)."""
        self._whole_calls = 0
        self._slot: int | None = None
        """Not parallel: the parser's index of the call that holds the one place, while it is not known broken."""
        self._done: set[int] = set()  # the parser's indexes of the calls that came whole
        self._named_id = mode.new_call_id()

    def feed(self, text: str) -> list[Delta]:
        """The deltas `text` (the next part of the reply) releases."""
        if self._reasoning is None:
            return self._answer(text)
        return self._reply_parts(text)

    def finish(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        """At the reply's end: the held-back deltas, and the finish_reason to report."""
        deltas: list[Delta] = []
        if self._reasoning is not None:
            deltas = self._reply_parts(None)
        more, finish_reason = self._finish_answer(finish_reason)
        return deltas + more, finish_reason

    def _reply_parts(self, text: str | None) -> list[Delta]:
        """The deltas of the reasoning stream's next parts (None: its last ones), in order: the reasoning, then the
        answer; with `message_starts`, a harmony reply's messages apart, each after a ``message_start``."""
        stream = self._reasoning
        assert stream is not None
        deltas: list[Delta] = []
        for kind, part, starts in stream.feed_parts(text) if text is not None else stream.finish_parts():
            deltas += self._message_end() + [{"message_start": True}] if starts else []
            deltas += [{"reasoning": part}] if kind == "reasoning" else self._answer(part)
        return deltas

    def _message_end(self) -> list[Delta]:
        """Before the next harmony message: what the ``openai`` tool stream held back of the last one's text."""
        if self.mode.kind != "auto" or self._calls_stream is None:
            return []
        return self._deltas(self._calls_stream.end_message())

    def _answer(self, text: str) -> list[Delta]:
        kind = self.mode.kind
        if not text:
            return []
        if kind == "none":
            return [{"content": text}]
        if kind == "named":
            first = self._calls == 0
            self._calls = 1
            function = {"name": self.mode.function, "arguments": text} if first else {"arguments": text}
            return [{"tool_calls": [{"index": 0, **({"id": self._named_id, "type": "function"} if first else {}),
                                     "function": function}]}]
        if kind == "required":
            self._text.append(text)
            return []
        assert self._calls_stream is not None
        return self._deltas(self._calls_stream.feed(text))

    def _finish_answer(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        kind = self.mode.kind
        if kind == "required":
            calls, rest = _required_calls("".join(self._text), self.mode.new_call_id)
            deltas = self._deltas([call.as_delta(index) for index, call in enumerate(calls)])
            deltas += [{"content": rest}] if rest else []  # cut short (length): the unfinished call's text
            return deltas, "tool_calls" if calls and finish_reason == "stop" else finish_reason
        if kind == "auto":
            assert self._calls_stream is not None
            deltas = self._deltas(self._calls_stream.finish())
            if self._whole_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            return deltas, finish_reason
        return [], finish_reason

    def _deltas(self, parts: list[ReplyPart]) -> list[Delta]:
        deltas: list[Delta] = []
        for part in parts:
            if isinstance(part, ToolCallDelta):
                deltas += self._call_delta(part)
            elif part:
                if self._slot is not None and self._slot not in self._done:
                    self._slot = None  # content after a call's pieces before it was whole: it broke (its text)
                deltas.append({"content": part})
        return deltas

    def _call_delta(self, part: ToolCallDelta) -> list[Delta]:
        if part.index not in self._indexes:  # a new call; parallel_tool_calls false: the first whole one only (a
            # streamed call that broke after its first piece stays as it was sent, and leaves its place to the next)
            takes = self.mode.parallel or self._slot is None
            self._indexes[part.index] = self._calls if takes else None
            self._calls += takes
            self._slot = part.index if takes else self._slot
        index = self._indexes[part.index]
        if index is None:
            return []
        if part.done:
            self._done.add(part.index)
        self._whole_calls += part.done
        arguments = _escaped_surrogates(part.arguments)
        if part.name is not None:  # a name read from JSON may hold a lone surrogate as well
            return [{"tool_calls": [{"index": index, "id": part.id, "type": "function",
                                     "function": {"name": _escaped_surrogates(part.name), "arguments": arguments}}]}]
        return [{"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}] if arguments else []


def _escaped_surrogates(arguments: str) -> str:
    """Arguments JSON whose strings hold lone surrogates (a model's ``"\\ud83d"``, decoded by the parser) with
    them written back as JSON escapes: the same JSON, and text that UTF-8 (the response) can encode. A call's name
    too: as the model wrote it."""
    return _LONE_SURROGATE.sub(lambda match: f"\\u{ord(match.group()):04x}", arguments)


def _required_calls(text: str, new_id: Callable[[], str]) -> tuple[list[ToolCall], str]:
    """A ``required`` reply's calls, and the text after the last whole one that is no call (stripped; "" when none).

    The constrained text is a JSON list of calls unless it was cut short (``max_tokens``, a stop string): then the
    calls written whole before the cut are calls (as vLLM's stream sent them) and the unfinished one's text is
    content, as an ``auto`` reply's unfinished call (vLLM's whole reply drops both); text that is not a list of
    calls at all is all content."""
    try:
        value = json.loads(text)
    except ValueError:
        values, rest = _whole_items(text)
    else:
        values, rest = (value, "") if isinstance(value, list) else ([], text)
    calls: list[ToolCall] = []
    for item in values:
        call = call_from_value(item, ("parameters",))
        if call is None:
            return [], text
        calls.append(ToolCall(call.name, call.arguments, new_id()))
    return calls, rest.strip()


def _whole_items(text: str) -> tuple[list[Any], str]:
    """The items written whole of a JSON list cut short, and the text after the last of them and its comma (all of
    `text` when none was whole)."""
    decoder, items, rest = json.JSONDecoder(), [], text
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        return [], text
    pos += 1
    while True:
        try:
            item, pos = decoder.raw_decode(text, _skip_space(text, pos))
        except ValueError:
            return items, rest
        items.append(item)
        pos = _skip_space(text, pos)
        pos += text.startswith(",", pos)
        rest = text[pos:]


def _skip_space(text: str, pos: int) -> int:
    """`pos` past the JSON whitespace there."""
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def merge_deltas(deltas: list[Delta], tools: bool, reasoning_parser: bool = False) -> dict[str, Any]:
    """The assistant message the deltas stream: content joined, each call's argument parts joined.

    Without tool calling or a reasoning parser the content is always a str
    (as before tools existed); with either, None when there is none (as
    OpenAI, and vLLM for a reply that is all reasoning). ``reasoning`` is
    there when a reasoning parser found some.
    """
    content = "".join(d["content"] for d in deltas if "content" in d)
    reasoning = "".join(d["reasoning"] for d in deltas if "reasoning" in d)
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for item in delta.get("tool_calls", ()):
            if item["index"] == len(calls):
                calls.append({"id": item["id"], "type": "function",
                              "function": {"name": item["function"]["name"], "arguments": ""}})
            calls[item["index"]]["function"]["arguments"] += item["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant",
                               "content": content if content or not (tools or reasoning_parser) else None}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message
