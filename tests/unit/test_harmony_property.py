"""gpt-oss's harmony replies (asyncllm/harmony.py) against a naive reading of its docs, whole and in any pieces.

Drawn: replies built of harmony messages (analysis; commentary to ``functions.NAME``, the recipient after the
channel or in the role part, with ``<|constrain|>json``, `` json`` or nothing; commentary without a recipient, a
preamble; final; other recipients), the first without ``<|start|>assistant``, each ended by ``<|end|>``,
``<|call|>`` or ``<|return|>``, bodies of drawn text (``<``, ``|``, pieces of markers, unicode) or JSON arguments
(written with drawn separators, indents and escapes); malformed replies (stray and partial markers, headers broken by
an end marker or a new ``<|start|>``, messages without an end marker, no channel, broken call bodies, text before the
first message or after ``<|return|>``); and any of them cut anywhere (the model hit max_tokens). Each reply is fed
whole, and in drawn pieces (1-9 characters, so markers are split anywhere).

The model (`reference_items`) reads the reply's text split on the seven markers, by the rules of the module's
docstring and docs/gpt-oss.md: the reply's start opens a message when it is ``<|channel|>`` or `` to=`` (the first
message's ``<|start|>assistant`` is the prompt's); elsewhere a message opens at ``<|start|>``; its header runs to
``<|message|>`` (an end marker or a new ``<|start|>`` first: the header was text, as written); its body runs to an end
marker (a ``<|start|>`` ends it too, and opens the next message; the reply's end ends it). Everything else is text
outside messages. A header's channel is the first word after ``<|channel|>``; its recipient a ``to=`` word in its role
part or after its channel (``<|constrain|>`` separates words). Read by ``openai_gptoss``: analysis bodies are
reasoning, the other messages' bodies content, each kind's messages (those with a body) joined by a newline; a message
with a recipient and the text outside messages are content, as written. Read by ``openai``: a message to
``functions.NAME`` (NAME not empty) whose body is one JSON object (JSON whitespace around) is call NAME, its
arguments ``json.dumps(json.loads(body), ensure_ascii=False)``; so is one ended by an end marker whose body (past
JSON whitespace) is not empty and does not start with ``{``, its arguments the body's JSON as json.dumps writes it
or, when it is no JSON, the body as written (vLLM's; until 2026-12-08 content); everything else is content as
written. Calls are numbered from 0; streamed, a broken call's first piece was sent, so it keeps its number. A call
message cut off after its JSON object, before ``<|call|>``, is a call (the module's "an unfinished body ends";
docs/gpt-oss.md's "or that is cut short" is read as a body cut inside its JSON). Not drawn: non-JSON whitespace after
a call's JSON (the parser takes any ``str.isspace`` there, json.loads none), repeated JSON keys (json_stream.py keeps
every copy).

Checked, whole and streamed: the reasoning, the content and the calls (names, arguments, numbers, ids) equal the
model's; the parsers' ``parse`` agree; streamed deltas join to the whole's, and after every piece what came out is
exactly what the model reads in the text so far, less what may still be a marker (the markers' starts that could
change the reading there: ``<|start|>`` outside messages, an end marker or ``<|start|>`` in a body, the reply's start
while it may open the first message), an unfinished header and an unfinished call message; a call's arguments are all
out once its JSON object closed; a call's first piece (id, name) comes at its header's ``<|message|>``; the
Responses API's parts (``apart``) are one per message, without it a delta's reasoning then content; ``end_message``
after any prefix releases exactly the text held outside messages, and the rest then reads as after a message. For
well-formed replies the model itself is checked against what the drawn messages say (reasoning and content hold no
marker, calls are the drawn ones).

Set ``HARMONY_PROPERTY_NO_SHRINK=1`` to skip shrinking (the mutation runs).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from asyncllm.harmony import HarmonyToolStream, parse_header
from asyncllm.reasoning import get_reasoning_parser
from asyncllm.tool_calls import ToolCallDelta, get_tool_parser

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
ENDS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
OPENERS = (CHANNEL, " to=")
"""What opens the reply's first message (docs/gpt-oss.md: its ``<|start|>assistant`` is the prompt's)."""
JSON_SPACE = " \t\n\r"
SPLIT = re.compile("(" + "|".join(map(re.escape, MARKERS)) + ")")
WORDS = re.compile(r"\s+|" + re.escape(CONSTRAIN))

PHASES = {"phases": [Phase.explicit, Phase.reuse, Phase.generate]} if os.environ.get(
    "HARMONY_PROPERTY_NO_SHRINK") else {}


# ----------------------------------------------------------------------------------------------------------------
# The model: the reply's text split on the markers.


@dataclass
class Message:
    """A message as the model reads it: its header as written, body, end marker ("" when a ``<|start|>`` or the
    reply's end ended it), and whether the text so far may still go on (a prefix's last message)."""

    header: str
    body: str
    end: str
    open: bool = False

    @property
    def written(self) -> str:
        return self.header + self.body + self.end

    @property
    def channel(self) -> str | None:
        return header_fields(self.header)[0]

    @property
    def recipient(self) -> str | None:
        return header_fields(self.header)[1]


def header_fields(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient): the first word after ``<|channel|>``; a ``to=`` word before or after it."""
    inner = header.removeprefix(START).removesuffix(MESSAGE)
    role, has_channel, after = inner.partition(CHANNEL)
    role_words = [w for w in WORDS.split(role) if w]
    channel_words = [w for w in WORDS.split(after) if w]
    recipient = next((w[len("to="):] for w in role_words + channel_words if w.startswith("to=")), None)
    channel = channel_words[0] if has_channel and channel_words and not channel_words[0].startswith("to=") else None
    return channel, recipient


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    return max([n for m in markers for n in range(1, len(m)) if text.endswith(m[:n])], default=0)


def read(text: str, first: bool = True) -> tuple[list[str | Message], str, str, str]:
    """The reply's text outside messages (str) and its ended messages, in order; then where its end is (outside,
    header or body) and the unfinished header's or body's text. `first`: the text starts the reply (it may open the
    first message); else it comes after a message (outside)."""
    items: list[str | Message] = []
    state, header, body = ("header" if first and text.startswith(OPENERS) else "outside"), "", ""
    for token in (t for t in SPLIT.split(text) if t):
        if state == "outside":
            if token == START:
                state, header = "header", START
            else:
                items.append(token)
        elif state == "header":
            if token == MESSAGE:
                state, header, body = "body", header + token, ""
            elif token == START:  # a new message: the broken header was text
                items.append(header)
                header = START
            elif token in ENDS:  # an end marker before <|message|>: the header was text
                items.append(header + token)
                state = "outside"
            else:
                header += token
        elif token in ENDS or token == START:
            items.append(Message(header, body, token if token in ENDS else ""))
            state, header = ("outside", "") if token in ENDS else ("header", START)
        else:
            body += token
    return items, state, header, body


def reference_state(text: str, first: bool = True) -> str:
    """Where the text so far ends: first (it may still open the first message), outside, header or body."""
    return "first" if first and any(opener.startswith(text) for opener in OPENERS) else read(text, first)[1]


def reference_items(text: str, whole: bool = True, first: bool = True) -> list[str | Message]:
    """The reply's text outside messages (str) and its messages, in order. Not `whole`: the text so far of a reply
    still coming, less what the parser may not know yet: a possible marker's start where it would change the
    reading, an unfinished header (the last message is then `open`)."""
    if not whole and reference_state(text, first) == "first":
        return []  # it may still open the first message
    items, state, header, body = read(text, first)
    if state == "header" and whole:
        items.append(header)  # an unfinished header is text
    if state == "body" and whole:
        items.append(Message(header, body, ""))  # an unfinished body ends
    if state == "body" and not whole:
        items.append(Message(header, body[:len(body) - partial_marker(body, (*ENDS, START))], "", open=True))
    if not whole and state == "outside" and items and isinstance(items[-1], str):
        items[-1] = items[-1][:len(items[-1]) - partial_marker(items[-1], (START,))]
    return items


def reference_reasoning(items: list[str | Message]) -> tuple[str, str]:
    """``openai_gptoss``'s (reasoning, content) of the model's items."""
    reasoning, content, said_content = [], [], False
    for item in items:
        if isinstance(item, str) or item.recipient is not None:
            content.append(item if isinstance(item, str) else item.written)
        elif item.body and item.channel == "analysis":
            reasoning.append(item.body)
        elif item.body:
            content.append("\n" * said_content + item.body)
            said_content = True
    return "\n".join(reasoning), "".join(content)


def reference_parts(items: list[str | Message]) -> list[tuple[str, str, bool]]:
    """``openai_gptoss``'s parts with ``apart``: one per message (starting), text outside messages raw."""
    parts = []
    for item in items:
        if isinstance(item, str):
            parts.append(("raw", item, False))
        elif item.recipient is not None:
            parts.append(("raw", item.written, True))
        elif item.body:
            parts.append(("reasoning" if item.channel == "analysis" else "content", item.body, True))
    return merged_parts(parts)


def merged_parts(parts: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    """Parts with each part that does not start a message joined to the one before it, when of the same kind."""
    out: list[tuple[str, str, bool]] = []
    for kind, text, starts in parts:
        if out and not starts and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text, out[-1][2])
        elif text:
            out.append((kind, text, starts))
    return out


def call_name(message: Message) -> str | None:
    """The function a message is addressed to (None: not ``functions.NAME``)."""
    recipient = message.recipient or ""
    return recipient.removeprefix("functions.") or None if recipient.startswith("functions.") else None


def json_arguments(body: str) -> str | None:
    """The arguments of a call whose body is `body`: one JSON object, JSON whitespace around (None if not)."""
    try:
        value = json.loads(body.strip(JSON_SPACE))
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def raw_arguments(message: Message) -> str | None:
    """The arguments of a call message ended by an end marker whose body does not start with ``{`` (after JSON
    whitespace; there is more): its JSON as json.dumps writes it, or the body as written when it is no JSON (vLLM's
    reading); None for any other message."""
    head = message.body.lstrip(JSON_SPACE)
    if not message.end or not head or head.startswith("{"):
        return None
    try:
        return json.dumps(json.loads(message.body), ensure_ascii=False)
    except (ValueError, RecursionError):
        return message.body


@dataclass
class ToolReading:
    """``openai``'s reading: content, calls (index, name, arguments), the calls whose first piece is out (streamed:
    every call message whose header was read, broken or not)."""

    content: str
    calls: list[tuple[int, str, str]]
    started: list[tuple[int, str]]


def reference_tools(items: list[str | Message], streamed: bool) -> ToolReading:
    """``openai``'s reading of the model's items; `streamed`: a broken call's number is used (its first piece went
    out). An `open` call message is held (neither content nor call yet), its first piece out when `streamed`."""
    content, calls, started, index = [], [], [], 0
    for item in items:
        name = None if isinstance(item, str) else call_name(item)
        if name is None:
            content.append(item if isinstance(item, str) else item.written)
            continue
        if streamed:
            started.append((index, name))
        if item.open:
            continue
        arguments = json_arguments(item.body)
        arguments = raw_arguments(item) if arguments is None else arguments
        if arguments is not None:
            calls.append((index, name, arguments))
        else:
            content.append(item.written)
        index += arguments is not None or streamed
    return ToolReading("".join(content), calls, started)


# ----------------------------------------------------------------------------------------------------------------
# The parsers, driven.


def pieces_of(text: str, sizes: list[int]) -> list[str]:
    """`text` cut into pieces of the drawn sizes (repeated)."""
    out, pos = [], 0
    while pos < len(text):
        out.append(text[pos:pos + sizes[len(out) % len(sizes)]])
        pos += len(out[-1])
    return out


@dataclass
class Calls:
    """What a `HarmonyToolStream`'s call pieces said, by number: first piece (id, name), arguments, done."""

    names: dict[int, str]
    ids: dict[int, str]
    arguments: dict[int, str]
    done: set[int]

    @classmethod
    def of(cls, deltas: list[ToolCallDelta]) -> "Calls":
        calls = cls({}, {}, {}, set())
        for d in deltas:
            if d.name is not None:
                assert d.index not in calls.names and d.id, d  # one first piece per call, with its id
                calls.names[d.index], calls.ids[d.index] = d.name, d.id
            assert d.index in calls.names and d.index not in calls.done, d  # no piece before the first, after done
            calls.arguments[d.index] = calls.arguments.get(d.index, "") + d.arguments
            if d.done:
                calls.done.add(d.index)
        assert len(set(calls.ids.values())) == len(calls.ids)
        return calls

    def whole(self) -> list[tuple[int, str, str]]:
        return [(i, self.names[i], self.arguments[i]) for i in sorted(self.done)]


def check_tool_stream(pieces: list[str], items: list[str | Message]) -> None:
    """`HarmonyToolStream` alone, streamed arguments or not: after every piece exactly the model's reading of the
    text so far; at the end the model's reading of the reply."""
    for streamed in (True, False):
        stream, content, deltas, seen = HarmonyToolStream(streamed), "", [], ""
        for piece in pieces:
            out = stream.feed(piece)
            seen += piece
            content += "".join(p for p in out if isinstance(p, str))
            deltas += [p for p in out if isinstance(p, ToolCallDelta)]
            check_tools_so_far(reference_items(seen, whole=False), content, Calls.of(deltas), streamed)
        out = stream.finish()
        content += "".join(p for p in out if isinstance(p, str))
        calls = Calls.of(deltas + [p for p in out if isinstance(p, ToolCallDelta)])
        expected = reference_tools(items, streamed)
        assert content == expected.content
        assert calls.whole() == expected.calls
        assert sorted(calls.names.items()) == (expected.started if streamed else [(i, n) for i, n, _ in expected.calls])
        if not streamed:
            assert all(calls.arguments[i] == a for i, _, a in expected.calls)  # one piece: the whole arguments


def check_tools_so_far(items: list[str | Message], content: str, calls: Calls, streamed: bool) -> None:
    """After a piece: the content and the calls done are the model's for the text so far; streamed, each call
    message whose header was read has its first piece out, and an open call's arguments are all out once its JSON
    object is."""
    expected = reference_tools(items, streamed)
    assert content == expected.content
    assert calls.whole() == expected.calls
    if not streamed:
        return
    assert sorted(calls.names.items()) == expected.started
    last = items[-1] if items else None
    if isinstance(last, Message) and last.open and call_name(last) is not None:
        arguments = json_arguments(last.body)
        if arguments is not None and last.body.rstrip(JSON_SPACE).endswith("}"):
            assert calls.arguments.get(expected.started[-1][0], "") == arguments


def check_reasoning_stream(pieces: list[str], items: list[str | Message]) -> None:
    """``openai_gptoss`` (`HarmonyReasoningStream`): after every piece exactly the model's reasoning and content
    of the text so far; at the end the model's; ``apart`` parts one per message, in order."""
    parser = get_reasoning_parser("openai_gptoss")
    stream, apart, joined = parser.stream(), parser.stream(apart=True), parser.stream()
    reasoning, content, parts, joined_parts, seen = "", "", [], [], ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content, seen = reasoning + r, content + c, seen + piece
        parts += apart.feed_parts(piece)
        joined_parts += check_joined(joined.feed_parts(piece))
        so_far = reference_items(seen, whole=False)
        assert (reasoning, content) == reference_reasoning(so_far), seen
        assert merged_parts(parts) == reference_parts(so_far), seen
    r, c = stream.finish()
    assert (reasoning + r, content + c) == reference_reasoning(items)
    assert merged_parts(parts + apart.finish_parts()) == reference_parts(items)
    joined_parts += check_joined(joined.finish_parts())
    assert ["".join(t for k, t, _ in joined_parts if k == kind) for kind in ("reasoning", "content")] == list(
        reference_reasoning(items))


def check_joined(parts: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    """Without ``apart`` a delta's parts are its joined reasoning, then its joined content (a tag parser's)."""
    assert [kind for kind, _, _ in parts] in ([], ["reasoning"], ["content"], ["reasoning", "content"])
    assert all(text and not starts for _, text, starts in parts)
    return parts


def check_chat_reply(pieces: list[str], items: list[str | Message]) -> None:
    """``openai_gptoss`` then ``openai`` (as `ChatReply` chains them: the reasoning stream's content into the tool
    stream): the model's reasoning, and its tool reading of the model's content."""
    reasoning_stream, tools = get_reasoning_parser("openai_gptoss").stream(), HarmonyToolStream(False)
    reasoning, parts = "", []
    for r, c in [*map(reasoning_stream.feed, pieces), reasoning_stream.finish()]:
        reasoning += r
        parts += tools.feed(c)
    parts += tools.finish()
    expected_reasoning, passed_on = reference_reasoning(items)
    expected = reference_tools(reference_items(passed_on), streamed=False)
    assert reasoning == expected_reasoning
    assert "".join(p for p in parts if isinstance(p, str)) == expected.content
    assert Calls.of([p for p in parts if isinstance(p, ToolCallDelta)]).whole() == expected.calls


def check_parsers_whole(reply: str, items: list[str | Message]) -> None:
    """The registry's parsers' ``parse`` of the whole reply: the model's reading (None where empty; with calls
    the tool parser's content is stripped)."""
    reasoning, content = reference_reasoning(items)
    assert get_reasoning_parser("openai_gptoss").parse(reply) == (reasoning or None, content or None)
    expected = reference_tools(items, streamed=False)
    parsed = get_tool_parser("openai").parse(reply)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(n, a) for _, n, a in expected.calls]
    assert parsed.content == ((expected.content.strip() if expected.calls else expected.content) or None)


def check_release(reply: str, cut: int) -> None:
    """`HarmonyToolStream.end_message` (`HarmonyScanner.release`) after each of the reply's prefixes: outside
    messages it gives the text held back as a possible marker's start (all the text so far is then out); in a header
    or a body, nothing. After the `cut` one, the rest of the reply reads as text after a message (outside) when the
    release was outside messages (once there was text: at the reply's start nothing changes), else as if nothing had
    happened."""
    for end in range(len(reply) + 1):
        stream = HarmonyToolStream(False)
        fed = stream.feed(reply[:end])
        released = stream.end_message()
        inside = reference_state(reply[:end]) in ("header", "body")
        before = reference_tools(reference_items(reply[:end]), streamed=False)
        text = "".join(p for p in fed + released if isinstance(p, str))
        assert released == [] if inside else text == before.content, reply[:end]
        if end != cut:
            continue
        parts = fed + released + stream.feed(reply[end:]) + stream.finish()
        content = "".join(p for p in parts if isinstance(p, str))
        calls = [(p.name, p.arguments) for p in parts if isinstance(p, ToolCallDelta)]
        if inside or end == 0:
            expected = reference_tools(reference_items(reply), streamed=False)
        else:
            after = reference_tools(reference_items(reply[end:], first=False), streamed=False)
            expected = ToolReading(before.content + after.content, before.calls + after.calls, [])
        assert (content, calls) == (expected.content, [(n, a) for _, n, a in expected.calls])


def check_all(reply: str, sizes: list[int]) -> None:
    """Every check, on the reply whole and fed in the drawn pieces."""
    items = reference_items(reply)
    assert "".join(i if isinstance(i, str) else i.written for i in items) == reply  # the model loses nothing
    for pieces in ([reply], pieces_of(reply, sizes)):
        check_reasoning_stream(pieces, items)
        check_tool_stream(pieces, items)
        check_chat_reply(pieces, items)
    check_parsers_whole(reply, items)


# ----------------------------------------------------------------------------------------------------------------
# Drawn replies.

TEXT = ["a", "Paris", "2+2 is 4.", " ", "\n", "<", "|", ">", "<|", "|>", "<|chan", "nel|>", "<|en", "d|>", "<|st",
        "art|>", "<|ca", "ll", "<|ret", "<|mess", "age|>", "assistant", "to=functions.f", " to=", "commentary",
        "json", "{", "}", '"', "é", "Ω", "😀", "\t"]
"""Body text: markers' pieces, never a whole marker (`no_marker` drops the bodies where pieces join into one)."""
BROKEN_BODIES = ["Paris", '{"city": "Par', "[1]", '{"a": 1} and more', '{"a": 1}}', "", " \n", "{}x", "null",
                 '"{}"', '{"a": 01}', "{'a': 1}", "\u00a0{}", "<|ca"]
"""Call bodies that are not one JSON object."""
JUNK = [END, RETURN, CALL, MESSAGE, CHANNEL, CONSTRAIN, START, START + "assistant", START + "assistant" + CHANNEL
        + "final", CHANNEL + "analysis", "<|", "<|chan", "<|st", "<|en", "|>", "text", "\n", " to=", " to=functions.f",
        "é", "json"]
"""Malformed pieces between messages: stray and partial markers, broken headers."""
SUFFIXES = ["", " ", " " + CONSTRAIN + "json", CONSTRAIN + "json", " json", " code"]
"""What may follow a call's recipient or channel in its header."""
KINDS = ("analysis", "final", "preamble", "call", "role call", "other recipient", "no channel")
WELL_FORMED = KINDS[:-1]


def no_marker(text: str) -> bool:
    return not any(marker in text for marker in MARKERS)


body_text = st.lists(st.sampled_from(TEXT), max_size=8).map("".join).filter(no_marker)
json_strings = st.lists(st.characters(blacklist_categories=("Cs",)) | st.sampled_from(["<|", "|>", "\\", "é", '"']),
                        max_size=5).map("".join).filter(no_marker)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20) | st.floats(allow_nan=False, allow_infinity=False)
    | json_strings, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_strings, inner, max_size=3),
    max_leaves=6)


@st.composite
def json_bodies(draw: st.DrawFn) -> str:
    """A JSON object as a model may write it: drawn separators, indent and escapes, JSON whitespace around."""
    value = draw(st.dictionaries(json_strings, json_values, max_size=4))
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" , ", " : ")]))
    text = json.dumps(value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 0, 2])),
                      separators=separators)
    space = st.text(st.sampled_from(JSON_SPACE), max_size=2)
    return draw(space) + text + draw(space)


@dataclass(frozen=True)
class Drawn:
    """A drawn message: its kind (`KINDS`), function name, header suffix, body and end marker."""

    kind: str
    name: str
    suffix: str
    body: str
    end: str

    def render(self, first: bool) -> str:
        """Its text; the reply's first message has no ``<|start|>assistant`` (the prompt's)."""
        role = "" if first else START + "assistant"
        header = {
            "analysis": CHANNEL + "analysis",
            "final": CHANNEL + "final" + self.suffix.replace(" code", ""),
            "preamble": CHANNEL + "commentary",
            "call": CHANNEL + "commentary to=functions." + self.name + self.suffix,
            "role call": " to=functions." + self.name + CHANNEL + "commentary" + self.suffix,
            "other recipient": CHANNEL + "analysis to=browser.search" + self.suffix,
            "no channel": "",
        }[self.kind]
        return role + header + MESSAGE + self.body + self.end

    def arguments(self) -> str | None:
        """The call it is (its arguments), if it is one."""
        if self.kind not in ("call", "role call") or not self.name:
            return None
        arguments = json_arguments(self.body)
        return raw_arguments(Message("", self.body, self.end)) if arguments is None else arguments


@st.composite
def messages(draw: st.DrawFn, ends: tuple[str, ...] = ENDS, kinds: tuple[str, ...] = (*KINDS,)) -> Drawn:
    """A message of one of `kinds`, ended by one of `ends`."""
    kind = draw(st.sampled_from(kinds))
    name = draw(st.sampled_from(["get_weather", "add", "f", "a.b", "x_1", ""]) if "call" in kind else st.just("f"))
    body = draw(json_bodies() | st.sampled_from(BROKEN_BODIES) if "call" in kind else body_text)
    return Drawn(kind, name, draw(st.sampled_from(SUFFIXES)), body, draw(st.sampled_from(ends)))


def render(drawn: list[Drawn]) -> str:
    return "".join(m.render(first=i == 0) for i, m in enumerate(drawn))


def drawn_readings(drawn: list[Drawn]) -> tuple[str, str, list[tuple[str, str]]]:
    """What the drawn messages say: the reasoning, the content after both parsers, the calls (name, arguments)."""
    reasoning = "\n".join(m.body for m in drawn if m.kind == "analysis" and m.body)
    shown = [m.body for m in drawn if m.kind in ("final", "preamble") and m.body]
    content, calls, said = [], [], False
    for i, m in enumerate(drawn):
        if m.arguments() is not None:
            calls.append((m.name, m.arguments()))
        elif m.kind in ("call", "role call", "other recipient"):
            content.append(m.render(first=i == 0))  # not a call: as written
        elif m.kind != "analysis" and m.body:
            content.append("\n" * said + m.body)
            said = True
    assert said == bool(shown)
    return reasoning, "".join(content), calls


sizes_ = st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=12)


@st.composite
def replies(draw: st.DrawFn) -> str:
    """Malformed replies: messages (maybe without an end marker) between junk; text maybe before them."""
    parts = draw(st.lists(st.one_of(messages(ends=(*ENDS, "")).map(lambda m: m.render(first=False)),
                                    st.sampled_from(JUNK), body_text), max_size=6))
    first = draw(st.none() | messages(ends=(*ENDS, "")))
    return (first.render(first=True) if first else "") + "".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# The properties.


@settings(max_examples=150, deadline=None, **PHASES)
@given(drawn=st.lists(messages(kinds=WELL_FORMED), max_size=5), sizes=sizes_)
@example(drawn=[Drawn("analysis", "f", "", "First Paris.", END),
                Drawn("call", "get_weather", " " + CONSTRAIN + "json", '{"city": "Paris"}', CALL),
                Drawn("analysis", "f", "", "", END),  # an empty message: no newline of its own
                Drawn("analysis", "f", "", "Then add.", END),
                Drawn("role call", "add", " json", '{"a": 1,\n "b": -0.5e1, "c": 2.50, "d": 1E2}', CALL)],
         sizes=[6, 5])  # cut inside markers: <|chan + nel|>
@example(drawn=[Drawn("role call", "add", "", '{"a": "é <|"}', CALL)], sizes=[1])  # a first message that is a call
@example(drawn=[Drawn("preamble", "f", "", "Let me check <", END), Drawn("call", "f", "", "{}", CALL),
                Drawn("final", "f", "", "Sunny.", RETURN)], sizes=[2, 1])  # a preamble is content
@example(drawn=[Drawn("call", "add", "", "{}", CALL), Drawn("call", "add", "", "nope", CALL),
                Drawn("call", "get_weather", "", "{}", CALL)], sizes=[3])  # a call whose body is no JSON: its text the
# arguments, as vLLM's (until 2026-12-08 content)
def test_well_formed_replies_read_as_their_messages(drawn: list[Drawn], sizes: list[int]) -> None:
    """A reply of drawn messages: the model reads the drawn messages (analysis is reasoning, final and preambles
    content, calls the drawn ones, no marker in reasoning nor, without a message that is not a call, in content),
    and the parsers, whole and in any pieces, read what the model reads."""
    reply = render(drawn)
    reasoning, content, calls = drawn_readings(drawn)
    items = reference_items(reply)
    assert [i for i in items if isinstance(i, str)] == []  # nothing outside messages
    assert reference_reasoning(items)[0] == reasoning
    passed_on = reference_tools(reference_items(reference_reasoning(items)[1]), streamed=False)
    assert (passed_on.content, [(n, a) for _, n, a in passed_on.calls]) == (content, calls)
    assert no_marker(reasoning)
    kept = any(m.arguments() is None and m.kind in ("call", "role call", "other recipient") for m in drawn)
    assert no_marker(content) or kept
    check_all(reply, sizes)


@settings(max_examples=250, deadline=None, **PHASES)
@given(reply=replies() | st.lists(messages(kinds=WELL_FORMED), max_size=5).map(render),
       cut=st.none() | st.integers(min_value=0), sizes=sizes_, release_at=st.integers(min_value=0))
# after <|return|>: text is content, a message a message
@example(reply="<|channel|>final<|message|>Done.<|return|> and after<|start|>assistant<|channel|>analysis"
         "<|message|>more<|end|>", cut=None, sizes=[4], release_at=0)
# unterminated: the message ends with the reply (released in its body: nothing)
@example(reply="<|channel|>analysis<|message|>still thinking <|st", cut=None, sizes=[1], release_at=46)
# a header broken by an end marker is text
@example(reply="<|start|>assistant<|channel|>final<|end|><|start|>assistant<|channel|>final<|message|>Ok.<|return|>",
         cut=None, sizes=[3], release_at=0)
# a <|start|> ends a body (a call's too)
@example(reply="<|channel|>analysis<|message|>a<|start|>assistant<|channel|>commentary to=functions.f<|message|>"
         '{"x": [1, 2.0]}<|start|>assistant<|channel|>final<|message|>b', cut=None, sizes=[2], release_at=0)
# no markers: all content, as written
@example(reply="Plain text, < and | too.", cut=None, sizes=[1], release_at=0)
# a preamble is content; a built-in tool's message stays as written
@example(reply="<|channel|>commentary<|message|>Let me see.<|end|><|start|>assistant<|channel|>commentary to=python"
         "<|message|>print(1)<|call|>", cut=None, sizes=[5], release_at=0)
# cut right after a call's JSON: its arguments are all out before the reply ends (then the body ends: a call)
@example(reply='<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}', cut=None, sizes=[1],
         release_at=0)
# cut inside <|call|>: the body is not one JSON object, the message is content
@example(reply=" to=functions.f<|channel|>commentary<|message|>{}<|ca", cut=None, sizes=[2], release_at=0)
# released while the reply's start may still be <|channel|>: the rest reads as text after a message
@example(reply="<|channel|>analysis<|message|>x<|end|>", cut=None, sizes=[9], release_at=5)
# released while "<" may start the first message: the "<|channel|>" after it is text after a message, no call
@example(reply="<<|channel|>commentary to=functions.f<|message|>{}<|call|>", cut=None, sizes=[9], release_at=1)
def test_any_reply_cut_anywhere_reads_as_the_model(reply: str, cut: int | None, sizes: list[int],
                                                   release_at: int) -> None:
    """Any reply (malformed ones, cut anywhere: max_tokens): the parsers, whole and in any pieces, read what the
    model reads, nothing lost; `end_message` releases what the tool stream holds outside messages."""
    if cut is not None:
        reply = reply[:cut % (len(reply) + 1)]
    check_all(reply, sizes)
    check_release(reply, release_at % (len(reply) + 1))


def test_headers_as_documented() -> None:
    """`parse_header`: the channel and recipient the model reads, for each header form drawn here."""
    for kind in KINDS:
        for suffix in SUFFIXES:
            for first in (True, False):
                text = Drawn(kind, "get_weather", suffix, "", "").render(first)
                header = parse_header(text)
                assert (header.text, header.channel, header.recipient) == (text, *header_fields(text))
                assert header.recipient == {"call": "functions.get_weather", "role call": "functions.get_weather",
                                            "other recipient": "browser.search"}.get(kind)
