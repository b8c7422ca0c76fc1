"""Chat message content as the chat template reads it: vLLM's chat template *content format*.

vLLM hands a message's content to the template in one of two shapes (``--chat-template-content-format``,
``LLM.chat(chat_template_content_format=...)``; vllm/entrypoints/chat_utils.py, vllm/renderers/hf.py):

- ``"string"``: one string, a list of text parts joined with ``"\\n"``, each image, video or audio part's
  placeholder text (the model's, `MultiModalProcessor.placeholder_text`) ahead of them unless the text holds it;
- ``"openai"``: a list of ``{"type": "text", "text": ...}`` parts (media parts in place), a string content too;
- ``"auto"`` (the default): ``"openai"`` when the template loops over a message's content
  (``{% for part in message['content'] %}``, through the names the template gives messages and their
  content; `detect_content_format`), else ``"string"``.

Either way a content of None is no parts ("" or []), and a tool message of text parts only is one joined string
(as vLLM: most templates take a tool result as a string). What vLLM reads as text is a text part here
(`text_part_text`): a bare string, an ``input_text`` or ``output_text`` part, a ``refusal`` or ``thinking`` part.
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.mistral_tokenizer import is_mistral

__all__ = ["CONTENT_FORMATS", "TEXT_PART_FIELDS", "check_content_format", "content_format_of", "detect_content_format",
           "formatted_messages", "is_text_part", "text_part_text", "with_text_parts"]

CONTENT_FORMATS = ("auto", "string", "openai")
TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}
"""The text-like part types vLLM reads as text, and the field each holds it in."""


def check_content_format(value: object, config: bool = False) -> None:
    """`InvalidRequestError` (a server's setting, `config`: `ConfigError`) unless `value` is one of
    `CONTENT_FORMATS`."""
    if value not in CONTENT_FORMATS:
        if config:
            raise ConfigError("chat_template_content_format", value, f"one of {list(CONTENT_FORMATS)}")
        raise InvalidRequestError("chat_template_content_format",
                                  f"must be one of {list(CONTENT_FORMATS)}, got {value!r}")


def content_format_of(given: str, tokenizer: Any, chat_template: str | None = None,
                      tools: list[dict[str, Any]] | None = None) -> str:
    """``"string"`` or ``"openai"``: `given` itself, or for ``"auto"`` what `detect_content_format` finds in
    `chat_template` (else the tokenizer's template for `tools`); no template at all: ``"string"``, as vLLM."""
    check_content_format(given)
    if given != "auto":
        return given
    if chat_template is None and is_mistral(tokenizer):  # mistral_common reads the parts itself, as in vLLM
        return "openai"
    if chat_template is None:
        try:
            chat_template = tokenizer.get_chat_template(None, tools=tools)
        except (ValueError, AttributeError):  # no template: rendering says so
            return "string"
    return detect_content_format(chat_template)


@functools.lru_cache(maxsize=32)
def detect_content_format(chat_template: str) -> str:
    """``"openai"`` when the Jinja `chat_template` loops over a message's content, else ``"string"`` (also for a
    template that does not parse: rendering reports that)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        root = _compile_jinja_template(chat_template).environment.parse(chat_template)
        return "openai" if next(_content_loops(root), None) is not None else "string"
    except Exception:  # noqa: BLE001 - jinja's TemplateSyntaxError, transformers' ImportError, a tuple target
        return "string"


def _content_loops(root: Any) -> Iterator[Any]:
    """The template's loops over a message's content: ``for x in message['content']`` (``message`` any loop
    variable over ``messages`` or a name assigned from it) or ``for x in content``."""
    from jinja2 import nodes

    message_names = {_name(loop.target) for loop in root.find_all(nodes.For)
                     if any(_reads(loop.iter, name) for name in _aliases(root, "messages"))}
    for loop in root.find_all(nodes.For):
        if any(_reads(loop.iter, name, "content") for name in message_names) \
                or isinstance(loop.iter, nodes.Name) and loop.iter.name == "content":
            _name(loop.target)  # a tuple target over content: vLLM's detection gives up there too ("string")
            yield loop


def _aliases(root: Any, name: str) -> list[str]:
    """`name` and every name ``{% set %}`` from it (``{% set loop_messages = messages[1:] %}``), transitively."""
    from jinja2 import nodes

    found, queue = [name], deque([name])
    while queue:
        source = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, source) and _name(assign.target) not in found:
                found.append(assign.target.name)
                queue.append(assign.target.name)
    return found


def _name(target: Any) -> str:
    """A loop's or assignment's target name; a tuple target (``for i, m in messages | enumerate``, or on the first
    loop over a message's content) is not followed (vLLM's detection gives up on it: ``"string"``)."""
    from jinja2 import nodes

    if not isinstance(target, nodes.Name):
        raise ValueError("a tuple loop target")
    return target.name


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """Whether `node` is `name` (or its `key`: ``name['key']`` / ``name.key``), through filters, tests and
    slices (``messages | reverse``, ``messages[1:]``)."""
    from jinja2 import nodes

    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    named = isinstance(getattr(node, "node", None), nodes.Name) and _reads(node.node, name)
    if isinstance(node, nodes.Getitem):
        return named and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and named and node.attr == key


def formatted_messages(messages: list[Any], content_format: str,
                       placeholder: Callable[[str], str] | None = None) -> list[Any]:
    """`messages` with each dict's content in `content_format` (``"string"`` or ``"openai"``); a content list's
    parts are text parts (``{"type": "text", "text": str}``) or media parts (``{"type": "image" | "video" |
    "audio"}``), which ``"openai"`` keeps in place and ``"string"`` writes as `placeholder` (a kind's text) does."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content", None), (str, list, type(None))):
            out.append(message)  # template_messages names what is wrong
            continue
        parts = _parts(i, message.get("content"))
        texts = [part["text"] for part in parts if part.get("type") == "text"]
        if content_format == "string" or message.get("role") == "tool" and len(texts) == len(parts):
            media = [part.get("type") for part in parts if part.get("type") != "text"]
            out.append({**message, "content": _string_content(i, texts, media, placeholder)})
        else:
            out.append({**message, "content": parts})
    return out


def _string_content(i: int, texts: list[str], media: list[str], placeholder: Callable[[str], str] | None) -> str:
    """A message's ``"string"`` content as vLLM writes it: its texts joined with ``"\\n"``, after one placeholder per
    medium that the text does not already hold (in the order of their kinds' first parts; with no text, the
    placeholders alone)."""
    text = "\n".join(texts)
    if not media:
        return text
    if placeholder is None:
        raise InvalidRequestError("messages", f"item {i}: image, video or audio parts need a multimodal model")
    missing: list[str] = []
    for mark, count in Counter(placeholder(kind) for kind in media).items():
        if not mark:  # a model whose prompt writes no mark (CLIP's image prompt): the text is the model's to judge
            continue
        left = count - text.count(mark)
        if left < 0:
            raise InvalidRequestError("messages", f"item {i}: its text holds {text.count(mark)} {mark!r} placeholders "
                                                  f"but the message has {count} such media parts")
        missing += [mark] * left
    return "\n".join([*missing, text] if text else missing)  # media alone: no newline after them (vLLM's)


def _parts(i: int, content: str | list[Any] | None) -> list[dict[str, Any]]:
    """A content as parts: None no parts, a string one text part, a list's text-like parts as text parts
    (`text_part_text`; one vLLM skips is dropped), its other dicts (media parts) as they are."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for part in content:
        if is_text_part(part):
            text = text_part_text(i, part)
            if text is not None:
                parts.append({"type": "text", "text": text})
        elif isinstance(part, dict):
            parts.append(part)
        else:
            raise InvalidRequestError("messages", f"item {i}: a content part must be a string or a dict, "
                                                  f"got {part!r:.80}")
    return parts


def with_text_parts(messages: list[Any]) -> list[Any]:
    """`messages` with each content list's text-like parts as text parts ``{"type": "text", "text": str}``."""
    return [{**message, "content": _parts(i, message["content"])}
            if isinstance(message, dict) and isinstance(message.get("content"), list) else message
            for i, message in enumerate(messages)]


def is_text_part(part: object) -> bool:
    """Whether vLLM reads content `part` as text: a string, or a dict whose ``type`` is in `TEXT_PART_FIELDS`."""
    return isinstance(part, str) or isinstance(part, dict) and isinstance(part.get("type"), str) \
        and part["type"] in TEXT_PART_FIELDS


def text_part_text(i: int, part: str | dict[str, Any]) -> str | None:
    """A text-like part's text (`is_text_part`), as vLLM's ``_parse_chat_message_content_part``: a bare string, a
    ``text``, ``input_text`` or ``output_text`` part's ``text``, a ``refusal``'s ``refusal``, a ``thinking``'s
    ``thinking``; None for a ``text`` or ``refusal`` part whose text is None (vLLM skips it)."""
    if isinstance(part, str):
        return part
    kind = part["type"]
    field = TEXT_PART_FIELDS[kind]
    text = part.get(field)
    if text is None and kind in ("text", "refusal"):
        return None
    if not isinstance(text, str):
        raise InvalidRequestError("messages", f"item {i}: a {kind} part needs a str {field!r}, got {text!r:.80}")
    return text
