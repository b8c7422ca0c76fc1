"""Tool-call formats whose calls sit in delimited blocks read whole at their end (vLLM's parser names):

- ``deepseek_v3`` (DeepSeek-V3 / R1): ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and a fenced JSON block, ``<｜tool▁call▁end｜>``;
- ``deepseek_v31`` (DeepSeek-V3.1 / V3.2): per call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``;
- ``kimi_k2`` (Kimi K2): per call ``<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}
  <|tool_call_end|>`` inside ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>`` (the call's id is
  its ``functions.NAME:N``, as vLLM's);
- ``glm45`` (GLM-4.5 / 4.6 / 4.7): ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs,
  ``</tool_call>``, each value typed by the request's tool schemas as ``qwen3_coder``'s (tool_call_xml.py);
- ``minimax_m2`` (MiniMax-M2): ``<minimax:tool_call>`` blocks of one or more
  ``<invoke name="NAME"><parameter name="K">V</parameter></invoke>``, values typed as ``glm45``'s;
- ``hunyuan_a13b`` (Hunyuan-A13B), ``jamba`` (Jamba 1.5+): ``<tool_calls>`` and a JSON list of
  ``{"name": ..., "arguments": {...}}``, ``</tool_calls>``;
- ``seed_oss`` (Seed-OSS): Qwen3-Coder's XML calls inside ``<seed:tool_call>`` ... ``</seed:tool_call>``.

A block is read when its end tag comes; one that does not parse as a call is content, as in every other format.
A ``deepseek_v3``, ``deepseek_v31`` or ``kimi_k2`` call's arguments are its JSON object's text as the model wrote it
(``kimi_k2``'s less the spaces around it), as vLLM passes them on; the other formats' are ``json.dumps``'s text.
The section markers around the calls are not content. The markers are special tokens: the server keeps special
tokens in the text of replies these parsers read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from asyncllm.tool_call_streams import ReplyPart, TaggedBlockStream, ToolCallDelta, partial_tag_suffix, tool_call_id
from asyncllm.tool_call_xml import CLOSED_PARAMETER, XmlCallsStream, typed_value

__all__ = ["BlockCall", "FORMATS", "SeedXmlStream", "WholeBlockStream", "block_stream", "deepseek_v3_call",
           "deepseek_v31_call", "glm45_call", "json_list_calls", "kimi_k2_call", "minimax_m2_calls"]

BlockCall = tuple[str, str, str | None]
"""(name, arguments as JSON text, the call's id or None for a new one)."""

_DS_SEP = "<｜tool▁sep｜>"
_DS_FENCED = re.compile(r"\s*(?:function)?" + re.escape(_DS_SEP) + r"(.+?)\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL)
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_KIMI_ARGS = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"\s*(functions\.([^:\s]+):\d+)\s*$")
_MINIMAX_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def _object_as_written(text: str) -> str | None:
    """``text`` itself when it is a JSON object's text (the model's spacing, key order and escapes kept, as vLLM
    passes these formats' arguments on); None when it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return text if isinstance(value, dict) else None


def deepseek_v3_call(body: str, types: dict[str, dict[str, str]]) -> list[BlockCall] | None:
    match = _DS_FENCED.match(body)
    arguments = _object_as_written(match.group(2)) if match else None
    return None if match is None or arguments is None else [(match.group(1).strip(), arguments, None)]


def deepseek_v31_call(body: str, types: dict[str, dict[str, str]]) -> list[BlockCall] | None:
    name, sep, rest = body.partition(_DS_SEP)
    arguments = _object_as_written(rest) if sep else None
    return None if arguments is None or not name.strip() else [(name.strip(), arguments, None)]


def kimi_k2_call(body: str, types: dict[str, dict[str, str]]) -> list[BlockCall] | None:
    head, sep, rest = body.partition(_KIMI_ARGS)
    match = _KIMI_ID.match(head) if sep else None
    arguments = _object_as_written(rest.strip()) if match else None  # vLLM's regex leaves out the spaces around
    return None if match is None or arguments is None else [(match.group(2), arguments, match.group(1))]


def glm45_call(body: str, types: dict[str, dict[str, str]]) -> list[BlockCall] | None:
    name_end = body.find("<arg_key>")
    name = (body if name_end < 0 else body[:name_end]).strip()
    if not name or "<" in name or "\n" in name:
        return None
    arguments, end = {}, len(body) if name_end < 0 else name_end
    while (match := _GLM_PAIR.match(body, end)) is not None:
        key = match.group(1).strip()
        arguments[key] = typed_value(match.group(2).strip(), types.get(name, {}).get(key))
        end = match.end()
    if body[end:].strip():
        return None
    return [(name, json.dumps(arguments, ensure_ascii=False), None)]


def json_list_calls(body: str, types: dict[str, dict[str, str]]) -> list[BlockCall] | None:
    """A JSON list of ``{"name": ..., "arguments": {...}}`` objects (Hunyuan-A13B's, Jamba's)."""
    try:
        values = json.loads(body)
    except ValueError:
        return None
    if not isinstance(values, list) or not values:
        return None
    calls = []
    for value in values:
        arguments = value.get("arguments", {}) if isinstance(value, dict) else None
        if not isinstance(arguments, dict) or not isinstance(value.get("name"), str):
            return None
        calls.append((value["name"], json.dumps(arguments, ensure_ascii=False), None))
    return calls


def minimax_m2_calls(body: str, types: dict[str, dict[str, str]]) -> list[BlockCall] | None:
    """``<invoke name="f"><parameter name="k">v</parameter>...</invoke>``, one or more in a block."""
    calls, end = [], 0
    while (match := _MINIMAX_INVOKE.match(body, end)) is not None:
        name, inner, arguments, pos = match.group(1), match.group(2), {}, 0
        while (param := _MINIMAX_PARAMETER.match(inner, pos)) is not None:
            key, value = param.group(1), param.group(2).removeprefix("\n").removesuffix("\n")
            arguments[key] = typed_value(value, types.get(name, {}).get(key))
            pos = param.end()
        if inner[pos:].strip():
            return None
        calls.append((name, json.dumps(arguments, ensure_ascii=False), None))
        end = match.end()
    return calls if calls and not body[end:].strip() else None


class WholeBlockStream(TaggedBlockStream):
    """Blocks between ``open_tag`` and ``close_tag``, each read whole by ``read`` at its end (one call in one piece,
    or content); the ``markers`` around a run of calls are dropped from the content."""

    def __init__(self, open_tag: str, close_tag: str,
                 read: Callable[[str, dict[str, dict[str, str]]], list[BlockCall] | None],
                 markers: tuple[str, ...] = (), types: dict[str, dict[str, str]] | None = None) -> None:
        super().__init__()
        self.OPEN, self.CLOSE = open_tag, close_tag
        self._read, self._markers, self._types = read, markers, types or {}
        self._body: list[str] = []
        self._held = ""  # content that may be the start of a marker
        self._ending = False

    def _open_block(self) -> None:
        self._body = []

    def _feed_block(self, text: str) -> list[ReplyPart]:
        self._body.append(text)
        return []

    def _close_block(self) -> list[ReplyPart]:
        calls = self._read("".join(self._body), self._types)
        if calls is None:
            return self._as_content()
        first, self._index, self._calls = self._index, self._index + len(calls), self._calls + len(calls)
        return [ToolCallDelta(first + i, arguments, name, call_id or tool_call_id(), done=True)
                for i, (name, arguments, call_id) in enumerate(calls)]

    def finish(self) -> list[ReplyPart]:
        self._ending = True
        return super().finish()

    def _spacing(self, parts: list[ReplyPart]) -> list[ReplyPart]:
        """The content without the markers; a marker's first characters held back until the next text shows
        whether it is one (each call flushes the content before it)."""
        out: list[ReplyPart] = []
        for part in parts:
            if isinstance(part, str):
                self._held += part
                continue
            out += [self._unmarked(self._held), part]
            self._held = ""
        text = self._held  # as written: a marker's start is read before the markers go (``<`` then a marker is text)
        # a marker's start goes on into the text held back as a call tag's start, if any (a block opened: into none)
        pending = "" if self._in_block else self._buffer
        keep = 0 if self._ending or self._in_block else max(
            (partial_tag_suffix(text + pending, m) - len(pending) for m in self._markers), default=0)
        keep = max(keep, 0)
        out.append(self._unmarked(text[: len(text) - keep]))
        self._held = text[len(text) - keep:]
        return super()._spacing(out)

    def _unmarked(self, text: str) -> str:
        for marker in self._markers:
            text = text.replace(marker, "")
        return text


class SeedXmlStream(XmlCallsStream):
    """Seed-OSS: Qwen3-Coder's XML calls inside ``<seed:tool_call>`` blocks (a parameter's ``</parameter>`` left
    out only at a function's end, its ``</function>`` or the block's end, as vLLM's ``seed_oss`` regex reads it)."""

    OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"
    PARAMETER = CLOSED_PARAMETER
    PARAMETER_ENDS = ("</parameter>",)


FORMATS: dict[str, tuple[str, str, Callable[[str, dict[str, dict[str, str]]], list[BlockCall] | None],
                         tuple[str, ...]]] = {
    "deepseek_v3": ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", deepseek_v3_call,
                    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")),
    "deepseek_v31": ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", deepseek_v31_call,
                     ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")),
    "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_end|>", kimi_k2_call,
                ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")),
    "glm45": ("<tool_call>", "</tool_call>", glm45_call, ()),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>", minimax_m2_calls, ()),
    "hunyuan_a13b": ("<tool_calls>", "</tool_calls>", json_list_calls, ()),
    "jamba": ("<tool_calls>", "</tool_calls>", json_list_calls, ()),
}
"""Parser name -> (a call's opening tag, its closing tag, its reader, the markers around the calls)."""


def block_stream(name: str, types: dict[str, Any]) -> WholeBlockStream:
    open_tag, close_tag, read, markers = FORMATS[name]
    return WholeBlockStream(open_tag, close_tag, read, markers, types)
