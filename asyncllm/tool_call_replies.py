"""The streams of formats whose reply ends in calls: ``mistral`` (content, then ``[TOOL_CALLS]`` and the calls),
``granite`` and ``phi4_mini_json`` (Mistral's list format after their own tag, opening the reply), and ``pythonic``
(read whole at the reply's end).

The calls part is calls only if all of it reads as calls (and there is one;
after a ``mistral`` JSON list, text is ignored, as vLLM's ``raw_decode``
ignores it); otherwise all of the reply is content, at its end, as
`ToolParser.parse` has always read it. Streamed (``stream_arguments``), a
call's first piece goes out once its name is read and its arguments as they
are read (tool_call_streams.py), but it is `done` only at the reply's end,
once the reply is known to be calls; a call that started streaming in a reply
that then is not calls stays as it was sent. Without ``stream_arguments``
every call waits for the reply's end.
"""

from __future__ import annotations

import abc
import ast
import json
from collections.abc import Callable
from dataclasses import replace

from asyncllm.json_stream import JSON_SPACE, JsonObjectScanner
from asyncllm.tool_call_streams import (CallObject, ReplyPart, ToolCallDelta, ToolCallDeltaStream, partial_tag_suffix,
                                        tool_call_id)

__all__ = ["ArgumentsObject", "MistralStream", "GraniteStream", "Phi4MiniStream", "PythonicStream",
           "pythonic_calls", "TOOL_CALLS", "ARGS", "GRANITE_TOOL_CALL", "GRANITE_STRING_TOOL_CALL", "FUNCTOOLS"]

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
GRANITE_TOOL_CALL, GRANITE_STRING_TOOL_CALL, FUNCTOOLS = "<|tool_call|>", "<tool_call>", "functools"


class ArgumentsObject:
    """A call whose name came before its arguments object (Mistral's ``name[ARGS]{...}``): the object's text is
    the arguments. Streamed, its first piece goes out at once."""

    def __init__(self, index: int, name: str, stream_arguments: bool, new_id: Callable[[], str] = tool_call_id) -> None:
        self.json = JsonObjectScanner()
        self.index, self.name, self.id = index, name, new_id()
        self._stream = stream_arguments
        self._sent = 0  # pieces of the object's text sent

    def first(self) -> list[ToolCallDelta]:
        """Its first piece (streaming; none without)."""
        return [ToolCallDelta(self.index, "", self.name, self.id)] if self._stream else []

    def feed(self, text: str) -> tuple[int, list[ToolCallDelta]]:
        pos = 0
        while not self.json.text and pos < len(text) and text[pos] in JSON_SPACE:
            pos += 1  # json.loads takes JSON whitespace before the object, nothing else
        if not self.json.text and pos < len(text) and text[pos] != "{":
            self.json.fail()
            return pos, []
        used = pos + self.json.feed(text[pos:])
        new = "".join(self.json.text[self._sent:]) if self._stream else ""
        self._sent = len(self.json.text)
        return used, [ToolCallDelta(self.index, new)] if new else []

    def close(self) -> list[ToolCallDelta] | None:
        if not self.json.done:
            return None
        if self._stream:
            return [ToolCallDelta(self.index, done=True)]  # all of it was sent
        return [ToolCallDelta(self.index, "".join(self.json.text), self.name, self.id, done=True)]


class _CallsReplyStream(ToolCallDeltaStream):
    """A reply that opens with one of `OPENERS` is calls (read after it: `_between` reads what is outside
    calls, a call's reader the rest); any other reply is content, as it comes. With `CONTENT_FIRST`, the text
    before the first opener, wherever it is, is content and the calls follow it."""

    OPENERS: tuple[str, ...] = ()
    CONTENT_FIRST = False

    def __init__(self, stream_arguments: bool) -> None:
        self._stream_arguments = stream_arguments
        self._mode: str | None = None  # None: undecided, "content", "calls" or "broken"
        self._text: list[str] = []  # the reply not sent as content (all of it content if it is not calls)
        self._pending = ""  # calls: the text not read yet
        self._call: CallObject | ArgumentsObject | None = None
        self._held: list[ReplyPart] = []  # without stream_arguments: the calls, until the reply's end
        self._index = 0  # whole calls read
        self._trailing_space = False  # past whitespace that only the reply's end may follow
        self._blank = False  # undecided, and only whitespace has come (more of it is read once: linear time)

    def feed(self, text: str) -> list[ReplyPart]:
        if self._mode == "content":
            return [text] if text else []
        self._text.append(text)
        if self._mode is not None:
            self._pending += text
            return self._read() if self._mode == "calls" else []
        if self._blank and text.isspace():
            return []
        return self._content_first() if self.CONTENT_FIRST else self._decide()

    def finish(self) -> list[ReplyPart]:
        if self._mode == "content":
            return []
        if self._mode == "calls" and self._call is None and self._index and self._complete():
            if self._stream_arguments:  # the calls were sent: now they are known whole
                return [ToolCallDelta(index, done=True) for index in range(self._index)]
            return self._held
        text = "".join(self._text)  # not calls: all of it is content
        return [text] if text else []

    @abc.abstractmethod
    def _between(self, parts: list[ReplyPart]) -> bool:
        """Read `_pending` outside a call (maybe opening one, or breaking the reply); False to wait for more."""

    def _complete(self) -> bool:
        """At the reply's end, outside a call: whether what was read is whole."""
        return True

    def _call_text(self) -> str:
        """What of `_pending` the open call may read ("" to wait for more)."""
        return self._pending

    def _decide(self) -> list[ReplyPart]:
        text = "".join(self._text)
        head = text.lstrip()
        if not head or any(opener.startswith(head) for opener in self.OPENERS):
            self._blank = not head
            return []  # whitespace, or an opener's first characters
        opener = next((opener for opener in self.OPENERS if head.startswith(opener)), None)
        if opener is None:
            self._mode = "content"
            return [text]
        self._mode, self._pending = "calls", head[len(opener):]
        return self._read()

    def _content_first(self) -> list[ReplyPart]:
        """Content up to the first opener (held back while the text may end in its start); then the calls."""
        text, opener = "".join(self._text), self.OPENERS[0]  # only a held-back tail was kept: linear
        start = text.find(opener)
        end = start if start >= 0 else len(text) - partial_tag_suffix(text, opener)
        parts: list[ReplyPart] = [text[:end]] if end > 0 else []
        self._text = [text[end:]]  # what is not sent: the opener's possible start, or the opener and the calls
        if start >= 0:
            self._mode, self._pending = "calls", text[start + len(opener):]
            parts += self._read()
        return parts

    def _read(self) -> list[ReplyPart]:
        parts: list[ReplyPart] = []
        while self._mode == "calls" and self._pending:
            if self._call is None:
                if not self._between(parts):
                    break
                continue
            text = self._call_text()
            if not text:
                break
            parts += self._feed_call(text)
        if self._stream_arguments:
            return parts
        self._held += parts
        return []

    def _feed_call(self, text: str) -> list[ReplyPart]:
        """`text` (the start of `_pending`) to the open call; its pieces."""
        assert self._call is not None
        used, deltas = self._call.feed(text)
        self._pending = self._pending[used:]
        if self._call.json.error:
            self._mode = "broken"
        elif self._call.json.done:
            return [*deltas, *self._close()]
        return list(deltas)

    def _close(self) -> list[ReplyPart]:
        assert self._call is not None
        call, self._call = self._call, None
        deltas = call.close()
        if deltas is None:
            self._mode = "broken"
            return []
        self._index = call.index + 1
        if not self._stream_arguments:
            return list(deltas)
        return [replace(delta, done=False) for delta in deltas]  # done once the reply is known to be calls

    def _trailing(self) -> None:
        """Whitespace that only the reply's end may follow (``text.strip()`` drops it there)."""
        if self._pending[:1].isspace():
            self._pending, self._trailing_space = self._pending[1:], True
        else:
            self._mode = "broken"


class MistralStream(_CallsReplyStream):
    """``mistral``: content, then after ``[TOOL_CALLS]`` a JSON list of ``{"name", "arguments"}`` objects
    (tokenizers before v11; text after the list is ignored), or ``name[ARGS]{...}`` after each ``[TOOL_CALLS]``
    (v11 and later)."""

    OPENERS = (TOOL_CALLS,)
    CONTENT_FIRST = True
    TRAILING_IGNORED = True
    NAMED_CALLS = True
    """``name[ARGS]{...}`` calls are read (only a JSON list otherwise)."""

    def __init__(self, stream_arguments: bool, new_id: Callable[[], str] = tool_call_id) -> None:
        """`new_id`: the calls' id maker (the ``mistral`` parser's: `mistral_tool_call_id`)."""
        super().__init__(stream_arguments)
        self._state = "start"  # start; v11: name, after (an object); a list: item, next, end
        self._name: list[str] = []
        self._new_id = new_id

    def _complete(self) -> bool:
        return self._state in ("after", "end") and not self._pending.strip()

    def _call_text(self) -> str:
        if self._state != "after":
            return self._pending  # an item of a list: [TOOL_CALLS] is no tag there
        tag = self._pending.find(TOOL_CALLS)
        if tag == 0:
            self._mode = "broken"  # the next call began inside this one's object
        end = tag if tag >= 0 else len(self._pending) - partial_tag_suffix(self._pending, TOOL_CALLS)
        return self._pending[:end]

    def _between(self, parts: list[ReplyPart]) -> bool:
        if self._state == "start":
            self._pending = self._pending.lstrip()
            if self._pending:
                self._state = "item" if self._pending[0] == "[" else "name"
                self._pending = self._pending.removeprefix("[")
                if self._state == "name" and not self.NAMED_CALLS:
                    self._mode = "broken"
            return bool(self._pending)
        if self._state == "name":
            return self._read_name(parts)
        if self._state == "after":
            return self._after_object()
        return self._list_step(parts)

    def _read_name(self, parts: list[ReplyPart]) -> bool:
        """The call's name, up to ``[ARGS]``; its arguments object follows."""
        end, tag = self._pending.find(ARGS), self._pending.find(TOOL_CALLS)
        if 0 <= tag and (end < 0 or tag < end):
            self._mode = "broken"  # a call without [ARGS]
            return True
        if end < 0:
            keep = max(partial_tag_suffix(self._pending, ARGS), partial_tag_suffix(self._pending, TOOL_CALLS))
            self._name.append(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        name = ("".join(self._name) + self._pending[:end]).strip()
        self._pending, self._name, self._state = self._pending[end + len(ARGS):], [], "after"
        if not name:
            self._mode = "broken"
        else:
            self._call = ArgumentsObject(self._index, name, self._stream_arguments, self._new_id)
            parts += self._call.first()
        return True

    def _after_object(self) -> bool:
        """JSON whitespace after a call's object, then the next call's ``[TOOL_CALLS]`` or the reply's end."""
        if not self._trailing_space:
            self._pending = self._pending.lstrip(JSON_SPACE)
        if not self._trailing_space and self._pending.startswith(TOOL_CALLS):
            self._pending, self._state = self._pending[len(TOOL_CALLS):], "name"
        elif not self._trailing_space and TOOL_CALLS.startswith(self._pending):
            return False  # "" or the tag's first characters
        else:
            self._trailing()
        return True

    def _list_step(self, parts: list[ReplyPart]) -> bool:
        if self._state != "end":
            self._pending = self._pending.lstrip(JSON_SPACE)
        char = self._pending[:1]
        if not char:
            return False
        if self._state == "end" and self.TRAILING_IGNORED:
            self._pending = ""  # as vLLM's raw_decode: what follows the list is not read
        elif self._state == "end":
            self._trailing()
        elif self._state == "item" and char == "{":
            self._state = "next"
            self._call = CallObject(self._index, ("arguments",), self._stream_arguments, self._new_id)
        elif self._state == "next" and char in ",]":
            self._pending, self._state = self._pending[1:], "item" if char == "," else "end"
        else:
            self._mode = "broken"  # not a call, an empty list, or a comma before "]"
        return True


class GraniteStream(MistralStream):
    """``granite``: ``<|tool_call|>`` (Granite 3.0) or ``<tool_call>`` (3.1) then a JSON list of
    ``{"name", "arguments"}`` objects."""

    OPENERS = (GRANITE_TOOL_CALL, GRANITE_STRING_TOOL_CALL)
    CONTENT_FIRST = TRAILING_IGNORED = NAMED_CALLS = False


class Phi4MiniStream(MistralStream):
    """``phi4_mini_json``: ``functools`` then a JSON list of ``{"name", "arguments"}`` objects (Phi-4-mini),
    wherever it starts (vLLM searches the reply for it): text before it is content, as Mistral's, text after the
    list is dropped."""

    OPENERS = (FUNCTOOLS,)
    NAMED_CALLS = False


def pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments) of each call of a Python list of calls with literal keyword arguments:
    ``[f(a=1), g(b="x")]``; None when `text` is not one."""
    text = text.removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:  # a set, bytes or a complex number: literals JSON cannot write, so content (as vLLM's)
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(arguments) != len(node.keywords):
                return None  # **kwargs
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, RecursionError, MemoryError):
            return None
    return calls


class PythonicStream(ToolCallDeltaStream):
    """``pythonic``: a reply that opens with ``[`` (or ``<|python_start|>``) is calls, read whole at its end
    (`pythonic_calls`); any other reply is content, as it comes."""

    OPENERS = ("[", "<|python_start|>")

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "content" or "calls"

    def feed(self, text: str) -> list[ReplyPart]:
        if self._mode == "content":
            return [text] if text else []
        self._buffer += text
        if self._mode == "calls":
            return []  # read whole at the end
        head = self._buffer.lstrip()
        if not head or any(opener.startswith(head) for opener in self.OPENERS):
            return []  # whitespace, or an opener's first characters: not decided yet
        self._mode = "calls" if head.startswith(self.OPENERS) else "content"
        if self._mode == "calls":
            return []
        text, self._buffer = self._buffer, ""
        return [text]

    def finish(self) -> list[ReplyPart]:
        text, self._buffer = self._buffer, ""
        calls = pythonic_calls(text.strip()) if self._mode == "calls" else None
        if not calls:
            return [text] if text else []
        return [ToolCallDelta(index, arguments, name, tool_call_id(), done=True)
                for index, (name, arguments) in enumerate(calls)]
