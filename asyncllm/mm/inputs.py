"""What a caller hands the multimodal processor (asyncllm/mm/processor.py): a prompt's images, videos and audios
(`MultiModalInputs`, also split out of OpenAI-style chat messages by `split_chat_media`), and the prompt it gets
back, expanded, for the core (`MultiModalPrompt`)."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.mm.audios import AudioInput
from asyncllm.mm.images import ImageInput, check_uuid
from asyncllm.mm.videos import VideoInput
from asyncllm.protocol import MultiModalItem

__all__ = ["MultiModalInputs", "MultiModalPrompt", "split_chat_media", "uuid_error"]


@dataclass
class MultiModalInputs:
    """A prompt's images, videos and audios, and the caller's uuid of each (None: keyed by its content hash)."""

    images: list[ImageInput] = dataclass_field(default_factory=list)
    image_uuids: list[str | None] | None = None
    videos: list[VideoInput] = dataclass_field(default_factory=list)
    video_uuids: list[str | None] | None = None
    audios: list[AudioInput] = dataclass_field(default_factory=list)
    audio_uuids: list[str | None] | None = None
    locations: dict[str, list[str]] | None = None
    """Where each input of a kind ("image", "video", "audio") was given, for its errors: a chat's
    ``messages[i].content[j]`` (`split_chat_media`); None: ``<field>[<index>]``."""


@dataclass
class MultiModalPrompt:
    """A prompt ready for the core: expanded token ids and its items (key-only on a cache hit)."""

    token_ids: list[int]
    items: list[MultiModalItem]
    inputs: MultiModalInputs
    """The caller's images and videos, kept until the core accepts the request (to resend after a cache miss)."""
    prompt_token_ids: list[int] = dataclass_field(default_factory=list)
    """The prompt before its placeholders were expanded."""
    overrides: dict[str, Any] = dataclass_field(default_factory=dict)
    """The request's ``mm_processor_kwargs`` (over the engine's), all of them: a resend after a cache miss processes
    the inputs again with them, the model's own (Qwen-Omni's ``use_audio_in_video``) deciding the same layout."""
    uuids: list[tuple[str, str] | None] = dataclass_field(default_factory=list)
    """Each item's (input field, caller's uuid) where a uuid keys it, else None, for the workers' errors
    (`uuid_error`); empty where the model's ``mm_prompt_items`` laid the items out."""


def uuid_error(field: str, detail: str, uuids: list[tuple[str, str] | None]) -> tuple[str, str]:
    """The workers' error of item ``mm_items[i]`` (asyncllm/mm/embeddings.py) as (field, detail): for an item a
    caller's uuid keys (`MultiModalPrompt.uuids`), its input's field, the detail naming the uuid (one given to other
    content before gets that content's features); any other error as it is."""
    index = field.removeprefix("mm_items[").removesuffix("]")
    owner = uuids[int(index)] if field.startswith("mm_items[") and index.isdigit() and int(index) < len(uuids) else None
    if owner is None:
        return field, detail
    return owner[0], f"uuid {owner[1]!r} ({field}): {detail}"


def split_chat_media(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], MultiModalInputs]:
    """OpenAI-style messages -> (messages with ``{"type": "image"}`` / ``{"type": "video"}`` parts the template
    renders, their images and videos).

    Image parts are ``{"type": "image", "image": ...}``, vLLM's ``{"type": "image_pil", "image_pil": PIL image}`` or
    ``{"type": "image_url", "image_url": {"url": ...}}``, video parts ``{"type": "video", "video": ...}`` or
    ``{"type": "video_url", "video_url": {"url": ...}}``, audio parts ``{"type": "audio", "audio": ...}``,
    ``{"type": "audio_url", "audio_url": {"url": ...}}`` or OpenAI's ``{"type": "input_audio", "input_audio":
    {"data": base64, "format": "wav"}}``, each with an optional ``"uuid"`` (the caller's key for it); URLs are
    refused (`load_image`, `read_video`, `read_audio`), so pass bytes, frames, waveforms or data: URLs. An audio
    part reaches the template as ``{"type": "audio", "audio": ""}`` (Qwen2-Audio's template looks for the key).
    """
    inputs = MultiModalInputs(image_uuids=[], video_uuids=[], audio_uuids=[],
                              locations={"image": [], "video": [], "audio": []})
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
                continue
            if kind not in ("image", "image_url", "image_pil", "video", "video_url", "audio", "audio_url",
                            "input_audio"):
                raise InvalidRequestError("messages", f"item {i} has a content part of unknown type {kind!r}")
            media = kind.removesuffix("_url").removesuffix("_pil").removeprefix("input_")
            value = _part_value(part, kind, f"messages[{i}].content[{j}]")
            getattr(inputs, media + "s").append(value)
            getattr(inputs, media + "_uuids").append(check_uuid(part.get("uuid"), f"messages[{i}].content[{j}].uuid"))
            inputs.locations[media].append(f"messages[{i}].content[{j}]")  # type: ignore[index]
            parts.append({"type": media, "audio": ""} if media == "audio" else {"type": media})
        out.append({**message, "content": parts})
    return out, inputs


def _part_value(part: dict[str, Any], kind: str, field: str) -> Any:
    """A media part's value: ``part[kind]``, a ``*_url`` part's ``url``, OpenAI's ``input_audio`` as a data: URL."""
    value = part.get(kind)
    if kind.endswith("_url") and isinstance(value, dict):
        return value.get("url")
    if kind == "input_audio":
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise InvalidRequestError(field, "an input_audio part is {'data': base64 str, 'format': 'wav' | 'mp3' ...}")
        return f"data:audio/{value.get('format', 'wav')};base64,{value['data']}"
    return value
