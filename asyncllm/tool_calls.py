"""Tool calling: the tools a chat template renders, and parsers of the calls a model writes.

A chat model that calls tools writes them as text in a format its chat
template taught it; a parser turns that text back into `ToolCall`s. The
parsers are vLLM's names for the same formats (``--tool-call-parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (Hermes 2/3, Qwen2.5, Qwen3, QwQ, and the bundled tiny model's
  template);
- ``llama3_json``: JSON objects ``{"name": ..., "parameters": {...}}`` anywhere
  in the reply (several joined by ``;``), maybe after ``<|python_tag|>`` (Llama 3.1-3.3);
- ``pythonic``: a Python list of calls ``[f(a=1), g(b="x")]`` with literal
  arguments (Llama 3.2 and 4, and other models prompted that way);
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON list of calls, or
  ``name[ARGS]{...}`` per call (Mistral's models);
- ``openai``: gpt-oss's harmony messages addressed to ``functions.NAME``, their
  body the JSON arguments (a body that does not start with ``{``: as vLLM's, its
  JSON re-dumped or its text as written; harmony.py; after the ``openai_gptoss``
  reasoning parser, which the server requires with it).
- ``granite`` / ``phi4_mini_json``: ``<|tool_call|>`` (or ``<tool_call>``) /
  ``functools`` and a JSON list of calls (Granite 3.x / Phi-4-mini);
- ``qwen3_coder``: ``<tool_call>`` blocks of ``<function=NAME>`` and
  ``<parameter=KEY>value</parameter>`` (Qwen3-Coder), the values typed by the
  request's tool schemas (tool_call_xml.py; `ToolParser.for_tools`); ``seed_oss``
  the same inside ``<seed:tool_call>`` blocks;
- ``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``, ``glm45``, ``minimax_m2``, ``hunyuan_a13b``, ``jamba``: calls
  in blocks
  between special tokens, each read whole at its end (tool_call_blocks.py).

Each parser reads a whole reply (`ToolParser.parse`) or a stream of text
deltas: `ToolParser.stream` reports each call once its text is complete,
`ToolParser.delta_stream` reports `ToolCallDelta` pieces, the ``hermes``,
``llama3_json``, ``mistral``, ``granite``, ``phi4_mini_json`` and ``openai``
calls' arguments as they are generated (``qwen3_coder``'s one parameter at a time) (tool_call_streams.py, tool_call_replies.py, harmony.py; ``pythonic``
calls whole, at the reply's end). Content is passed on as
it comes, except the few characters that may open a call. A call whose JSON
does not parse is left in the content (``"arguments": null`` is a call, its arguments
``null``, as vLLM's), so no text is ever lost (a streamed
call that broke after its first piece stays as it was sent, and its text is
content too). A call's arguments are its JSON as ``json.dumps`` writes it (``deepseek_v3``, ``deepseek_v31`` and
``kimi_k2``'s: as the model wrote it, as vLLM's). A ``llama3_json`` reply with calls has no content, as vLLM's
(streamed, the text before its first call has gone out as content already; what follows it is dropped).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.harmony import HarmonyToolStream
from asyncllm.tool_call_replies import GraniteStream, MistralStream, Phi4MiniStream, PythonicStream
from asyncllm.tool_call_llama3 import Llama3JsonStream
from asyncllm.tool_call_xml import XmlCallsStream, parameter_types
from asyncllm.tool_call_streams import (HermesStream, ReplyPart, ToolCallDelta, ToolCallDeltaStream,
                                        mistral_tool_call_id, partial_tag_suffix, tool_call_id)

__all__ = ["ToolCall", "ToolCallDelta", "ReplyPart", "ParsedReply", "ToolParser", "ToolCallDeltaStream",
           "ToolCallStream", "TOOL_PARSERS", "get_tool_parser",
           "check_tools", "check_parser_pair", "tool_call_id", "partial_tag_suffix",
           "call_from_value"]


@dataclass
class ToolCall:
    """One call of a tool: its name, and its arguments as a JSON object's text (as OpenAI sends them)."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)

    def as_delta(self, index: int) -> ToolCallDelta:
        """The whole call as one piece, call number `index` of its reply."""
        return ToolCallDelta(index, self.arguments, self.name, self.id, done=True)


@dataclass
class ParsedReply:
    """A reply split into its text content (None when there is none) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


def check_tools(tools: object) -> None:
    """`InvalidRequestError` unless `tools` is None or a list of OpenAI function tools.

    A tool is ``{"type": "function", "function": {"name": str, "description": str,
    "parameters": {JSON schema}}}`` (as vLLM's ``ChatCompletionToolsParam``: ``type`` may be left out,
    description and parameters left out or None).
    """
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", f"must be a list of tools, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError("tools", f"item {i} must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError("tools", f"item {i}: function needs a non-empty str 'name'")
        if not isinstance(function.get("description", ""), (str, type(None))):
            raise InvalidRequestError("tools", f"item {i}: function 'description' must be a str")
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise InvalidRequestError("tools", f"item {i}: function 'parameters' must be a JSON schema object")


class ToolCallStream:
    """One reply's deltas in, content deltas and whole calls out (`ToolParser.stream`)."""

    def __init__(self, parts: ToolCallDeltaStream) -> None:
        self._parts = parts
        """A stream that reports each call whole, in one piece."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content this delta releases, and the calls it completes."""
        return _content_and_calls(self._parts.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the reply's end: whatever was held back (an unfinished call's text is content)."""
        return _content_and_calls(self._parts.finish())


def _content_and_calls(parts: list[ReplyPart]) -> tuple[str, list[ToolCall]]:
    calls = [ToolCall(p.name, p.arguments, p.id) for p in parts if isinstance(p, ToolCallDelta)
             if p.name is not None and p.id is not None]
    return "".join(p for p in parts if isinstance(p, str)), calls


class ToolParser(abc.ABC):
    """A format of tool calls in a model's text."""

    needs_special_tokens = False
    """Its calls start with a special token (Mistral's ``[TOOL_CALLS]``): the server keeps special tokens in the
    reply's text (``skip_special_tokens`` false) for requests it reads, as vLLM does."""
    reasoning_parser: str | None = None
    """The reasoning parser it reads after, which the server requires with it (None: any, or none)."""
    new_call_id: Callable[[], str] = staticmethod(tool_call_id)
    """A fresh id for one of its calls (a named or ``required`` choice's too, on a server with this parser)."""

    @abc.abstractmethod
    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        """A parser of one reply's deltas.

        With `stream_arguments`, a call's first piece comes once its name is
        read and its arguments as they are generated (formats that cannot,
        whole); a call that then turns out broken stays as it was sent, and
        its text comes as content as well. Without it, each call comes whole,
        in one piece, once it is known to be one (a broken call is content only).
        """

    def for_tools(self, functions: dict[str, dict[str, Any]]) -> "ToolParser":
        """The parser for a request offering ``functions`` (name -> OpenAI function: its ``parameters`` schema);
        only a format whose arguments are typed by the schema (``qwen3_coder``) needs them."""
        return self

    def stream(self) -> ToolCallStream:
        """A parser of one reply's deltas that reports whole calls."""
        return ToolCallStream(self.delta_stream(stream_arguments=False))

    def parse(self, text: str) -> ParsedReply:
        """A whole reply's content and calls."""
        stream = self.stream()
        content, calls = stream.feed(text)
        tail, more = stream.finish()
        content += tail
        calls += more
        if calls:
            content = content.strip()
        return ParsedReply(content or None, calls)


def call_from_value(value: object, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from ``{"name": str, <one of arguments_keys>: {...}}``; None when `value` is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call."""

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        return HermesStream(stream_arguments)


class Llama3JsonToolParser(ToolParser):
    """``{"name": "f", "parameters": {...}}`` objects anywhere in the reply (``; `` between several), maybe after
    ``<|python_tag|>``."""

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        return Llama3JsonStream(stream_arguments)


class PythonicToolParser(ToolParser):
    """``[get_weather(city="Paris"), add(a=1, b=2)]``: a Python list of calls (Llama 3.2 / 4 and others)."""

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        return PythonicStream()


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": "f", "arguments": {...}}]`` or ``[TOOL_CALLS]f[ARGS]{...}`` (Mistral, Mixtral,
    Ministral, Devstral); ``[TOOL_CALLS]`` is a special token, so the server keeps special tokens for it."""

    needs_special_tokens = True
    new_call_id = staticmethod(mistral_tool_call_id)

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        return MistralStream(stream_arguments, self.new_call_id)


class OpenAIToolParser(ToolParser):
    """gpt-oss: ``<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>``
    per call. It reads what ``openai_gptoss`` leaves as content (the final channel's text, and the messages with a
    recipient as written); other recipients (built-in tools) stay content."""

    needs_special_tokens = True
    reasoning_parser = "openai_gptoss"

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        return HarmonyToolStream(stream_arguments)


class GraniteToolParser(ToolParser):
    """Granite 3.x: ``<|tool_call|>[{"name": "f", "arguments": {...}}, ...]``; ``<|tool_call|>`` is a special
    token, so the server keeps special tokens for it."""

    needs_special_tokens = True

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        return GraniteStream(stream_arguments)


class Phi4MiniJsonToolParser(ToolParser):
    """Phi-4-mini: ``functools[{"name": "f", "arguments": {...}}, ...]``."""

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        return Phi4MiniStream(stream_arguments)


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder: ``<tool_call><function=f><parameter=k>value</parameter></function></tool_call>``, values typed
    by the request's tool schemas (asyncllm/tool_call_xml.py)."""

    def __init__(self, types: dict[str, dict[str, str]] | None = None) -> None:
        self._types = types or {}

    def for_tools(self, functions: dict[str, dict[str, Any]]) -> "ToolParser":
        return Qwen3CoderToolParser(parameter_types(functions))

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        return XmlCallsStream(stream_arguments, self._types)


class BlockToolParser(ToolParser):
    """A format of delimited blocks read whole (asyncllm/tool_call_blocks.py): ``name`` picks it."""

    needs_special_tokens = True
    name = ""

    def __init__(self, types: dict[str, dict[str, str]] | None = None) -> None:
        self._types = types or {}

    def for_tools(self, functions: dict[str, dict[str, Any]]) -> "ToolParser":
        return type(self)(parameter_types(functions))

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        from asyncllm.tool_call_blocks import block_stream

        return block_stream(self.name, self._types)


class DeepSeekV3ToolParser(BlockToolParser):
    """DeepSeek-V3 / R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>f`` and a fenced JSON block."""

    name = "deepseek_v3"


class DeepSeekV31ToolParser(BlockToolParser):
    """DeepSeek-V3.1 / V3.2: ``<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``."""

    name = "deepseek_v31"


class KimiK2ToolParser(BlockToolParser):
    """Kimi K2: ``<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>``."""

    name = "kimi_k2"


class Glm45ToolParser(BlockToolParser):
    """GLM-4.5 / 4.6 / 4.7: ``<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``, values typed
    by the request's tool schemas."""

    name = "glm45"


class MiniMaxM2ToolParser(BlockToolParser):
    """MiniMax-M2: ``<minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke>...
    </minimax:tool_call>``, values typed by the request's tool schemas."""

    name = "minimax_m2"


class HunyuanA13BToolParser(BlockToolParser):
    """Hunyuan-A13B: ``<tool_calls>[{"name": "f", "arguments": {...}}, ...]</tool_calls>``."""

    name = "hunyuan_a13b"


class JambaToolParser(BlockToolParser):
    """Jamba 1.5+: ``<tool_calls>[{"name": "f", "arguments": {...}}, ...]</tool_calls>``."""

    name = "jamba"


class SeedOssToolParser(Qwen3CoderToolParser):
    """Seed-OSS: Qwen3-Coder's XML calls inside ``<seed:tool_call>`` blocks."""

    needs_special_tokens = True

    def for_tools(self, functions: dict[str, dict[str, Any]]) -> "ToolParser":
        return SeedOssToolParser(parameter_types(functions))

    def delta_stream(self, stream_arguments: bool = True) -> ToolCallDeltaStream:
        from asyncllm.tool_call_blocks import SeedXmlStream

        return SeedXmlStream(stream_arguments, self._types)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "pythonic": PythonicToolParser,
    "mistral": MistralToolParser, "openai": OpenAIToolParser, "qwen3_coder": Qwen3CoderToolParser,
    "granite": GraniteToolParser, "phi4_mini_json": Phi4MiniJsonToolParser, "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser, "kimi_k2": KimiK2ToolParser, "glm45": Glm45ToolParser,
    "seed_oss": SeedOssToolParser, "minimax_m2": MiniMaxM2ToolParser, "hunyuan_a13b": HunyuanA13BToolParser,
    "jamba": JambaToolParser, "qwen3_xml": Qwen3CoderToolParser, "llama4_pythonic": PythonicToolParser,
    "llama4_json": Llama3JsonToolParser,
}
"""Parser name (vLLM's ``--tool-call-parser`` names) -> parser; ``qwen3_xml``, ``llama4_pythonic`` and
``llama4_json`` are vLLM's other names for the ``qwen3_coder``, ``pythonic`` and ``llama3_json`` formats."""


def check_parser_pair(parser: ToolParser | None, reasoning_parser: str | None) -> None:
    """`ConfigError` when `parser` reads what a reasoning parser other than `reasoning_parser` leaves (``openai``
    without ``openai_gptoss`` would leave harmony's analysis and final messages, markers and all, in the content)."""
    if parser is not None and parser.reasoning_parser not in (None, reasoning_parser):
        raise ConfigError("reasoning_parser", reasoning_parser,
                          f"{parser.reasoning_parser!r} with this tool-call parser")


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`; a `ConfigError` naming the known ones otherwise."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ConfigError("tool_call_parser", name, f"one of {sorted(TOOL_PARSERS)}")
    return parser()
