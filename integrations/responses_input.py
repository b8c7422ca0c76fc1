"""The Responses API's ``input`` items as chat messages (`input_messages`), as vLLM's
``construct_chat_messages_with_tool_call`` builds them (vllm/entrypoints/openai/responses/utils.py).

One assistant turn often spans several items (a reasoning model's reply sent back: ``reasoning``, an assistant
``message``, its ``function_call`` items), so each of those fills in the assistant message just before it, as
vLLM's ``_construct_message_from_response_item`` does:

- a ``reasoning`` item sets that message's ``reasoning`` if it has none, else starts ``{"role": "assistant",
  "reasoning": text}`` (its text: the first ``content`` part's, else the first ``summary`` part's, else "");
- an assistant ``message`` sets that message's content if it has none, else starts a new assistant message;
- a ``function_call`` (with a ``namespace``: named ``<namespace>__<name>``, as vLLM flattens it) is appended to
  that message's ``tool_calls`` (parallel calls, or a reply with text before its
  call, are one turn), else starts ``{"role": "assistant", "tool_calls": [call]}``;
- a ``function_call_output`` is a tool message (a list of text parts joined with "\\n", as vLLM's chat parsing
  joins a tool message's parts).

Other messages keep their role (``user``, ``system``, ``developer``: the template decides what it makes of
``developer``, as vLLM and chat completions); a message without one of those roles is refused, as vLLM's item
models refuse it.
"""

from __future__ import annotations

from typing import Any

from asyncllm.chat_content import TEXT_PART_FIELDS, is_text_part, text_part_text
from asyncllm.errors import InvalidRequestError

__all__ = ["MESSAGE_ROLES", "input_items", "input_messages"]

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
"""A message item's roles (vLLM's ``EasyInputMessageParam``; a missing or other role is a 400 naming ``input``)."""


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as a list of items: a string is one user message."""
    return [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items


def input_messages(items: str | list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages of ``instructions`` (a system message) and ``input``: messages, reasoning, function calls and
    their outputs merged into assistant turns and tool messages as vLLM does (the module's docstring)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(input_items(items)):
        if not isinstance(item, dict):
            raise InvalidRequestError("input", f"item {i} must be an object")
        message = _message(i, item, _previous_assistant(messages))
        if message is not None:
            messages.append(message)
    return messages


def _previous_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def _message(i: int, item: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """Item `i` as a new message, or None where it filled in `previous` (the assistant message just before it)."""
    kind = item.get("type", "message")
    if kind == "message" and item.get("role") == "assistant":
        return _filled(previous, "content", _content(i, item.get("content")))
    if kind == "message":
        if item.get("role") not in MESSAGE_ROLES:
            raise InvalidRequestError("input", f"item {i}: a message's role must be one of {', '.join(MESSAGE_ROLES)}"
                                               f", got {item.get('role')!r}")
        return {"role": item["role"], "content": _content(i, item.get("content"))}
    if kind == "reasoning":
        return _filled(previous, "reasoning", _reasoning(i, item))
    if kind == "function_call":
        _require_strings(i, item, ("call_id", "name", "arguments"))
        name = f"{item['namespace']}__{item['name']}" if item.get("namespace") else item["name"]  # vLLM's flat name
        call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": item["arguments"]}}
        if previous is None:
            return {"role": "assistant", "tool_calls": [call]}
        previous["tool_calls"] = [*(previous.get("tool_calls") or []), call]
        return None
    if kind == "function_call_output":
        _require_strings(i, item, ("call_id",))
        return {"role": "tool", "tool_call_id": item["call_id"], "content": _text(i, item.get("output"))}
    raise InvalidRequestError("input", f"item {i}: type {kind!r} is not built (message, function_call, "
                                       "function_call_output, reasoning are)")


def _filled(previous: dict[str, Any] | None, key: str, value: object) -> dict[str, Any] | None:
    """`previous` given `key` where it has none (None: nothing new), else a new assistant message of it."""
    if previous is not None and previous.get(key) is None:
        previous[key] = value
        return None
    return {"role": "assistant", key: value}


def _reasoning(i: int, item: dict[str, Any]) -> str:
    """A reasoning item's text: its first content part's, else its first summary part's, else ""."""
    if item.get("encrypted_content"):
        raise InvalidRequestError("input", f"item {i}: a reasoning item's encrypted_content is not built")
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            first = parts[0] if isinstance(parts, list) else None
            if not isinstance(first, dict) or not isinstance(first.get("text"), str):
                raise InvalidRequestError("input", f"item {i}: a reasoning item's {key} must be a list of "
                                                   "{'type', 'text': str} parts")
            return first["text"]
    return ""


def _require_strings(i: int, item: dict[str, Any], keys: tuple[str, ...]) -> None:
    """vLLM's item models (``ResponseFunctionToolCall``, a function_call_output) require these as strings."""
    for key in keys:
        if not isinstance(item.get(key), str):
            raise InvalidRequestError("input", f"item {i}: a {item['type']} needs {key} as a string")


def _content(i: int, content: object) -> str | list[dict[str, Any]]:
    """A message's content for the chat path: its text, or a list's text parts as they are (the chat path reads
    them: asyncllm/chat_content.py's `text_part_text`) and ``input_image`` parts as ``image_url`` ones (a base64
    ``data:`` URL; ``detail`` dropped, as in chat completions), in order."""
    if not isinstance(content, list):
        return _text(i, content)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            if part.get("file_id") is not None or not isinstance(part.get("image_url"), str):
                raise InvalidRequestError("input", f"item {i}: an input_image needs image_url (a data: URL); "
                                                   "file_id is not built")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append(_text_part(i, part))
    return parts


def _text(i: int, content: object) -> str:
    """A string, or a list of text parts' texts joined with "\\n" (as vLLM's chat parsing joins them; a part
    vLLM skips, `text_part_text` None, is left out)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (text_part_text(i, _text_part(i, part)) for part in content)
        return "\n".join(text for text in texts if text is not None)
    raise InvalidRequestError("input", f"item {i}: content must be a string or a list of text parts")


def _text_part(i: int, part: Any) -> Any:
    """`part`, refused unless it is a text part (`is_text_part`)."""
    if not is_text_part(part):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidRequestError("input", f"item {i}: only text content parts ({', '.join(TEXT_PART_FIELDS)}; "
                                           f"in a message also input_image) are built, got {kind!r}")
    return part
