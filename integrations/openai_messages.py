"""OpenAI chat messages as the engine's chat takes them (`chat_messages`).

Text parts (and what vLLM reads as text: bare strings, ``input_text``, ``output_text``, ``refusal`` and ``thinking``
parts; a ``text`` or ``refusal`` part whose text is None is dropped) become ``{"type": "text", "text": str}``
(joined with "\\n" by the engine, or not: vLLM's chat template content format, asyncllm/chat_content.py), media
parts (``image_url``, ``video_url``, ``audio_url``, ``input_audio``) the engine's parts; an assistant message sent
back as history (the official client's ``message.model_dump()``) is read as vLLM reads it: keys whose value is
None dropped, OpenAI's assistant fields the template does not read ignored, ``reasoning`` (or
``reasoning_content``, each a string; the first non-empty, as vLLM's ``reasoning or reasoning_content``) given to
the template under both names. Other keys are a 400 naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

from asyncllm.chat_content import TEXT_PART_FIELDS, is_text_part, text_part_text
from asyncllm.errors import InvalidRequestError

__all__ = ["chat_messages", "has_media_parts", "media_url"]


_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_ASSISTANT_IGNORED_KEYS = frozenset({"refusal", "annotations", "audio", "function_call"})
"""OpenAI's assistant message fields the template does not read (as vLLM, ignored): the official client's
``message.model_dump()`` carries them when a reply is sent back as the next turn's history."""
_REASONING_KEYS = ("reasoning", "reasoning_content")


def chat_messages(messages: list[dict[str, Any]], images: bool = False,
                  media_root: Path | None = None) -> list[dict[str, Any]]:
    """Messages with content lists as text parts ``{"type": "text", "text": str}`` (the engine renders them in the
    chat template content format: joined with "\n" or as parts; asyncllm/chat_content.py), a content None as None.

    With ``images`` (a chat completion), a content list with ``image_url`` (or vLLM's ``video_url`` / ``audio_url``,
    OpenAI's ``input_audio``) parts is a list of text and media parts, which the engine's chat splits
    (asyncllm/mm/): the url is a base64 ``data:`` URL, or a ``file://`` URL under `media_root` (vLLM's
    ``--allowed-local-media-path``; `media_url`); http(s) URLs are refused by the engine, which fetches nothing.
    OpenAI's ``detail`` hint is dropped (as vLLM does), a part's ``uuid`` is the input's cache key (the pooling
    routes' chats with media take them too: openai_pooling_media.py). Elsewhere (tokenize, beam search) a media part
    is an error. An assistant's ``tool_calls`` and a tool message's ``tool_call_id`` go to
    the template (the engine parses the calls' JSON arguments for it), and so does its ``reasoning`` (or
    ``reasoning_content``; a string), as both ``reasoning`` and ``reasoning_content`` (as vLLM: Qwen3's and
    DeepSeek-R1's templates read the latter, others the former). Keys whose
    value is None are dropped; an assistant's ``refusal``, ``annotations``, ``audio`` and ``function_call`` are
    ignored (as vLLM); other keys are a 400 naming them.
    """
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):  # the engine joins text parts with "\n" or keeps them (content format)
            parts = (_content_part(i, j, part, images, media_root) for j, part in enumerate(content))
            content = [part for part in parts if part is not None]
        out.append({**_known_keys(i, message), "content": content})
    return out


def _known_keys(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """A message's keys the template reads, None values dropped; an assistant's reasoning under both names."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = []
    if message.get("role") == "assistant":
        reasoning = [(key, message.pop(key)) for key in _REASONING_KEYS if key in message]
        message = {key: value for key, value in message.items() if key not in _ASSISTANT_IGNORED_KEYS}
    extra = set(message) - _MESSAGE_KEYS
    if extra:
        raise InvalidRequestError("messages", f"item {i} has fields asyncllm does not build yet: {sorted(extra)}")
    for key, text in reasoning:
        if not isinstance(text, str):
            raise InvalidRequestError("messages", f"item {i}: {key} must be a string, got {type(text).__name__}")
    if reasoning:  # under both names, as vLLM: templates read either; the first non-empty ("reasoning" or ...)
        message["reasoning"] = message["reasoning_content"] = next((t for _, t in reasoning if t), "")
    return message


def _content_part(i: int, j: int, part: object, images: bool, media_root: Path | None) -> dict[str, Any] | None:
    """Message `i`'s part `j` as the engine's chat takes it (a text-like one as asyncllm/chat_content.py's
    `text_part_text` reads it); None for one vLLM skips (a text or refusal part whose text is None)."""
    if images and _is_image_part(part):
        return _image_part(part, media_root, f"messages[{i}].content[{j}]")
    if _is_image_part(part):  # a route that reads text only (tokenize's messages)
        raise InvalidRequestError("messages", f"item {i}: {part['type']} parts are not built on this route (text "
                                              f"only: media parts are taken by chat completions and the pooling "
                                              f"routes)")
    if not is_text_part(part):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidRequestError("messages", f"item {i}: only text ({', '.join(TEXT_PART_FIELDS)}), image_url, "
                                              "video_url, audio_url and input_audio content parts are built "
                                              f"(the media parts in chat completions), got {kind!r}")
    text = text_part_text(i, part)
    return None if text is None else {"type": "text", "text": text}


def has_media_parts(messages: list[Any]) -> bool:
    """Whether a message's content list holds a media part (``image_url``, ``video_url``, ``audio_url``,
    ``input_audio``): a pooling request's chat the engine renders with its media (openai_pooling_media.py)."""
    return any(isinstance(message, dict) and isinstance(message.get("content"), list)
               and any(_is_image_part(part) for part in message["content"]) for message in messages)


def _is_image_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "video_url", "audio_url", "input_audio")


def _image_part(part: dict[str, Any], media_root: Path | None, field: str) -> dict[str, Any]:
    """An OpenAI ``image_url`` (vLLM's ``video_url`` / ``audio_url``) part as the engine's chat takes it: the url
    string and the optional uuid; OpenAI's ``input_audio`` (``{"data": base64, "format"}``) with its uuid, other keys
    (``detail``) dropped. Errors name
    the part's `field` (``messages[i].content[j]``), as the engine's media errors do."""
    kind = part["type"]
    if kind == "input_audio":
        return {key: part[key] for key in ("type", "input_audio", "uuid") if key in part}
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(field, f"an {kind} part needs {kind}.url (a data: URL)")
    url = media_url(url, media_root, field)
    return {"type": kind, kind: {"url": url}, **({"uuid": part["uuid"]} if "uuid" in part else {})}


def media_url(url: str, media_root: Path | None, field: str) -> str:
    """What the engine reads for a client's media url: a ``data:`` or http(s) URL as it is (the engine decodes the
    first and refuses the second); a ``file://`` URL as its path, only inside `media_root` (the server's
    ``allowed_local_media_path``, resolved: symbolic links cannot leave it), as vLLM's ``MediaConnector``. Anything
    else is a 400: the engine reads a bare path as a file of the server's, which a client must never name. The
    schemes are matched as the engine matches them, literally (``DATA:...``, `` data:...`` would be paths to it)."""
    if url.startswith(("data:", "http://", "https://")):
        return url
    parts = urlsplit(url)  # a file: URL is parsed here (``FILE:``, ``file:/x`` too): only its resolved path goes on
    if parts.scheme != "file":
        raise InvalidRequestError(field, f"a media url must be a data:, http(s) or file: URL, got {url!r:.80}")
    if media_root is None:
        raise InvalidRequestError(field, "cannot load local files without --allowed-local-media-path "
                                         "(ServerLimits.allowed_local_media_path)")
    try:
        path = Path(url2pathname(parts.path)).resolve()
    except (OSError, ValueError) as exc:  # a NUL byte, a path the system refuses
        raise InvalidRequestError(field, f"the file {url!r:.120} is not a valid path: {exc}") from None
    if parts.netloc not in ("", "localhost") or media_root not in path.parents:
        raise InvalidRequestError(field, f"the file {url!r:.120} must be inside --allowed-local-media-path "
                                         f"{str(media_root)!r}")
    return str(path)
