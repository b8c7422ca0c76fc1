"""One JSON object read as its text comes: validated as `json.loads` reads it, re-serialized as `json.dumps` writes it.

The tool-call parsers stream a call's arguments while the model writes them
(tool_calls.py). A call's ``arguments`` text has always been
``json.dumps(value, ensure_ascii=False)`` of the JSON the model wrote, so
`JsonObjectScanner` writes that same text token by token: ``", "`` and
``": "`` between items, strings re-escaped as json.dumps escapes them (a
string's characters flow as they come), a number once it ends, as Python
prints it (``1.50`` is ``1.5``). Whatever is not known yet is held back: an
escape until it is whole (a high surrogate until the next escape shows
whether it pairs), a number or literal until the character after it. An
error is reported at the first character `json.loads` would refuse (raw
control characters in strings included, as its strict mode does).

The one difference from ``json.dumps(json.loads(text))``: an object that
repeats a key keeps every copy (json.loads keeps the last), since what was
sent cannot be taken back. A repeated top-level key starts that value over
and is listed in `JsonObjectScanner.repeated`.
"""

from __future__ import annotations

import json
import re

__all__ = ["JSON_SPACE", "JsonObjectScanner"]

JSON_SPACE = " \t\n\r"
"""The whitespace JSON allows between tokens (RFC 8259), not str.isspace's."""
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ENCODED = {chr(i): f"\\u{i:04x}" for i in range(0x20)} | {
    "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\"}
"""A decoded character -> its text in json.dumps's output (others are themselves, as with ensure_ascii=False)."""
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_BARE_CHARS = frozenset("+-.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERALS = frozenset({"true", "false", "null", "NaN", "Infinity", "-Infinity"})
_NUMBER_START = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][-+]?[0-9]*)?)?")
"""What a JSON number's text may begin with (``1.`` and ``1e-`` may go on; ``01``, ``1.e5`` and ``--`` may not)."""
_HEX = frozenset("0123456789abcdefABCDEF")


class JsonObjectScanner:
    """A JSON object's text in, piece by piece; its top-level values' json.dumps text out, as far as it is known.

    `text` is the whole object's text so far, ``values[key]`` that of a
    top-level key's value (lists of pieces); ``key in finished`` once the value is whole; `done` once the
    object closed (`feed` reads nothing after its ``}``: the caller decides what
    may follow); `error` once the text cannot be JSON (nothing more is read).
    Before the ``{`` any whitespace (``str.isspace``) is allowed, as
    ``json.loads(text.strip())`` allows it.
    """

    def __init__(self) -> None:
        self.text: list[str] = []
        self.values: dict[str, list[str]] = {}
        self.finished: set[str] = set()
        self.repeated: set[str] = set()
        self.first_values: dict[str, list[str]] = {}
        """A repeated top-level key's first value (`values` has the last, as json.loads keeps)."""
        self.done = False
        self.error = False
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._expect = "start"  # start, value, value_or_close, key, key_or_close, colon, comma_or_close
        self._key: str | None = None  # the top-level key whose value is being read
        self._key_text: list[str] = []  # a top-level key being read, as json.dumps writes it
        self._string: str | None = None  # in a string: "key" (a top-level key) or "value"
        self._escape = ""  # an escape being read: "\\", "\\u", "\\u0", ...
        self._high = ""  # a decoded high surrogate that the next escape may pair with
        self._bare = ""  # a number or literal being read

    def value(self, key: str) -> str:
        """The text of top-level `key`'s value so far ("" before it starts)."""
        return "".join(self.values.get(key, ()))

    def feed(self, text: str) -> int:
        """Read `text`; how many of its characters were read: all of them unless the object closed (or failed)."""
        pos = 0
        while pos < len(text) and not self.error and not self.done:
            if self._string is not None:
                pos = self._string_char(text, pos)
            elif self._bare and text[pos] in _BARE_CHARS:
                self._bare_char(text[pos])
                pos += 1
            elif self._bare:
                self._end_bare()  # the character after a number or literal ends it; it is read next
            else:
                self._structure(text[pos])
                pos += 1
        return pos

    def fail(self) -> None:
        """The text is not what the caller reads, after all: nothing more is read."""
        self.error = True

    def _emit(self, piece: str) -> None:
        self.text.append(piece)
        if self._string == "key":
            self._key_text.append(piece)
        elif self._key is not None:
            self.values[self._key].append(piece)

    def _structure(self, char: str) -> None:
        expect = self._expect
        if char in JSON_SPACE or (expect == "start" and char.isspace()):
            return
        if expect == "start" and char == "{":
            self._open(char)
        elif expect in ("value", "value_or_close"):
            self._value_char(char)
        elif expect in ("key", "key_or_close"):
            self._key_char(char)
        elif expect == "colon" and char == ":":
            self._colon()
        elif expect == "comma_or_close":
            self._comma_or_close(char)
        else:
            self.fail()

    def _value_char(self, char: str) -> None:
        if char in "{[":
            self._open(char)
        elif char == "]" and self._expect == "value_or_close":
            self._close(char)
        elif char == '"':
            self._string = "value"
            self._emit('"')
        elif char in _BARE_CHARS:
            self._bare_char(char)
        else:
            self.fail()

    def _key_char(self, char: str) -> None:
        if char == "}" and self._expect == "key_or_close":
            self._close(char)
        elif char == '"':
            self._string = "key" if len(self._stack) == 1 else "value"
            self._emit('"')
        else:
            self.fail()

    def _colon(self) -> None:
        self._expect = "value"
        if len(self._stack) > 1:
            self._emit(": ")
            return
        self.text.append(": ")
        key = json.loads("".join(self._key_text))
        self._key_text = []
        if key in self.values:
            self.repeated.add(key)  # json.loads keeps the last copy
            self.first_values.setdefault(key, self.values[key])
            self.finished.discard(key)
        self._key, self.values[key] = key, []

    def _comma_or_close(self, char: str) -> None:
        if char == ",":
            self._expect = "key" if self._stack[-1] == "{" else "value"
            if len(self._stack) > 1:
                self._emit(", ")
            else:
                self.text.append(", ")
        elif char == "]}"[self._stack[-1] == "{"]:
            self._close(char)
        else:
            self.fail()

    def _open(self, char: str) -> None:
        if self._stack:
            self._emit(char)
        else:
            self.text.append(char)
        self._stack.append(char)
        self._expect = "key_or_close" if char == "{" else "value_or_close"

    def _close(self, char: str) -> None:
        self._stack.pop()
        if not self._stack:
            self.text.append(char)
            self.done = True
            return
        self._emit(char)
        self._value_read()

    def _value_read(self) -> None:
        self._expect = "comma_or_close"
        if len(self._stack) == 1 and self._key is not None:
            self.finished.add(self._key)
            self._key = None

    def _bare_char(self, char: str) -> None:
        """A number's or literal's next character: an error at once when no number or literal begins so."""
        self._bare += char
        if not (_NUMBER_START.fullmatch(self._bare) or any(lit.startswith(self._bare) for lit in _LITERALS)):
            self.fail()

    def _end_bare(self) -> None:
        bare, self._bare = self._bare, ""
        text = bare if bare in _LITERALS else _number_text(bare)
        if text is None:
            self.fail()
            return
        self._emit(text)
        self._value_read()

    def _string_char(self, text: str, pos: int) -> int:
        """Read the string's text from `pos`; the position after what was read."""
        if self._escape:
            return self._escape_char(text[pos], pos)
        run = _STRING_RUN.match(text, pos)
        if run is not None:
            self._flush_high()
            self._emit(run.group())
            return run.end()
        char = text[pos]
        if char == "\\":
            self._escape = "\\"
        elif char == '"':
            self._flush_high()
            self._emit('"')
            self._end_string()
        else:
            self.fail()  # a raw control character: json.loads's strict mode refuses it
        return pos + 1

    def _end_string(self) -> None:
        self._string = None
        if self._expect in ("key", "key_or_close"):
            self._expect = "colon"
        else:
            self._value_read()

    def _escape_char(self, char: str, pos: int) -> int:
        self._escape += char
        escape = self._escape
        if len(escape) == 2 and escape[1] != "u":
            self._escape = ""
            if char not in _ESCAPES:
                self.fail()
            else:
                self._decoded(_ESCAPES[char], from_u=False)
        elif len(escape) > 2 and char not in _HEX:
            self.fail()
        elif len(escape) == 6:
            self._escape = ""
            self._decoded(chr(int(escape[2:], 16)), from_u=True)
        return pos + 1

    def _decoded(self, char: str, from_u: bool) -> None:
        """One decoded character; surrogates pair as json.loads pairs them (a high one, then a \\u low one)."""
        code = ord(char)
        if self._high and from_u and 0xDC00 <= code <= 0xDFFF:
            high, self._high = ord(self._high), ""
            self._emit(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
            return
        self._flush_high()
        if from_u and 0xD800 <= code <= 0xDBFF:
            self._high = char
        else:
            self._emit(_ENCODED.get(char, char))

    def _flush_high(self) -> None:
        if self._high:
            self._emit(self._high)  # unpaired: kept as it is, as json.loads and json.dumps keep it
            self._high = ""


def _number_text(bare: str) -> str | None:
    """A JSON number as json.dumps(json.loads(...)) writes it (1.50 -> 1.5, 1e2 -> 100.0); None when not one."""
    if not _NUMBER.fullmatch(bare):
        return None
    try:
        return json.dumps(json.loads(bare))
    except ValueError:  # an int longer than Python converts
        return None
