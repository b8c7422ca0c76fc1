"""The processor thread's multimodal entry points: prompt -> `MultiModalPrompt`, and cache-miss resends."""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from asyncllm import protocol
from asyncllm.chat_content import is_text_part, with_text_parts
from asyncllm.config_checks import is_int
from asyncllm.errors import InvalidRequestError
from asyncllm.mm.audios import is_one_audio
from asyncllm.mm.images import check_uuids
from asyncllm.mm.inputs import MultiModalInputs, MultiModalPrompt, split_chat_media
from asyncllm.mm.processor import MultiModalProcessor
from asyncllm.mm.videos import is_one_video
from asyncllm.tokenizer import chat_token_ids, render_chat

__all__ = ["MEDIA_KEYS", "multimodal_prompt", "plain_prompt", "resend_with_data"]

MEDIA_KEYS = frozenset({"images", "image_uuids", "videos", "video_uuids", "audios", "audio_uuids", "multi_modal_data",
                        "multi_modal_uuids", "mm_processor_kwargs"})
"""A dict prompt's keys for media, ours and vLLM's (`plain_prompt`: None or empty, each is no media)."""


def _is_multimodal_chat(messages: Any) -> bool:
    """Whether some message's content holds a part other than text (a list of text parts alone, bare strings and
    input_text parts too, is a text chat: `is_text_part`)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(not is_text_part(part) for part in m["content"]) for m in messages)


def multimodal_prompt(mm: MultiModalProcessor | None, prompt: Any, chat: bool,
                      template_kwargs: dict[str, Any] | None = None,
                      tools: list[dict[str, Any]] | None = None,
                      chat_template: str | None = None,
                      mm_processor_kwargs: dict[str, Any] | None = None,
                      content_format: str = "auto",
                      check_chat: Callable[[str], None] | None = None) -> MultiModalPrompt | None:
    """A dict prompt or chat messages with content parts, processed; None for a text-only prompt.

    `template_kwargs`, `tools`, `chat_template` and `mm_processor_kwargs` are `AsyncEngine.chat`'s
    (asyncllm.tokenizer.template_arguments), `content_format` vLLM's chat template content format
    (asyncllm/chat_content.py); a dict prompt carries its own ``mm_processor_kwargs``. `check_chat` sees a chat's
    rendered text before it is tokenized whole (``max_prompt_chars``: asyncllm/engine/prompt_tokens.py). Its length
    (media placeholders counted) is the caller's to check against max_model_len (asyncllm/engine/prompt_tokens.py).
    """
    if chat and not _is_multimodal_chat(prompt) or not chat and not isinstance(prompt, dict):
        return None
    if mm is None:  # a dict prompt's shape first: `plain_prompt` found no plain prompt in it
        field = "messages" if chat else _media_field(_check_dict_prompt(from_vllm_prompt(prompt)))
        raise InvalidRequestError(field, "this model takes no images, videos or audio (it is not a multimodal "
                                         "architecture)")
    field = "messages" if chat else "prompt.images"
    if chat:
        messages, inputs = split_chat_media(with_text_parts(prompt))  # bare strings, input_text...: text parts
        text = render_chat(mm.tokenizer, messages, True, template_kwargs, tools, chat_template, content_format,
                           placeholder=mm.placeholder_text)
        if check_chat is not None:  # refused before the costly tokenizing, as a text chat is
            check_chat(text)
        token_ids = chat_token_ids(mm.tokenizer, text)  # what apply_chat_template(tokenize=True) makes
    else:
        prompt = _check_dict_prompt(from_vllm_prompt(encoder_decoder_prompt(prompt, mm)))
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        inputs = MultiModalInputs(prompt.get("images", []), None, prompt.get("videos", []), None,
                                  prompt.get("audios", []), None)
        for kind in ("image", "video", "audio"):
            given = getattr(inputs, kind + "s")
            if isinstance(given, (list, tuple)):  # not a list: mm.process says so
                setattr(inputs, kind + "_uuids",
                        check_uuids(prompt.get(kind + "_uuids"), len(given), f"prompt.{kind}_uuids"))
        images = inputs.images if isinstance(inputs.images, (list, tuple)) else []
        token_ids = mm.encode_text(text, len(images)) if ids is None else _token_ids(ids, mm)
    overrides = mm_processor_kwargs if chat else prompt.get("mm_processor_kwargs")
    return mm.process(token_ids, inputs, field, overrides)


_DICT_KEYS = {"prompt", "prompt_token_ids", "images", "image_uuids", "videos", "video_uuids", "audios", "audio_uuids",
              "mm_processor_kwargs"}
_DICT_SHAPE = ("a dict prompt is {'prompt': str (or 'prompt_token_ids': [int]), 'images', 'image_uuids', 'videos', "
               "'video_uuids', 'audios', 'audio_uuids', 'mm_processor_kwargs', 'cache_salt' (optional)} or vLLM's "
               "{'prompt', 'multi_modal_data': {'image': ..., 'video': ..., 'audio': ...}}")


def _check_dict_prompt(prompt: dict[str, Any]) -> dict[str, Any]:
    """`prompt` (ours, after `from_vllm_prompt`) if its keys and the types of its text or token ids are right, else
    `InvalidRequestError` naming what is wrong: unknown keys, a text that is no str (``prompt``), token ids that are
    no list (``prompt.prompt_token_ids``), neither or both given (one of them empty with images: an image-only
    prompt, as CLIP's; the media are checked by the processor)."""
    unknown = set(prompt) - _DICT_KEYS
    if unknown:
        raise InvalidRequestError("prompt", f"unknown keys {sorted(unknown)}: {_DICT_SHAPE}")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if text is not None and not isinstance(text, str):
        raise InvalidRequestError("prompt", f"'prompt' must be a str, got {type(text).__name__}")
    if ids is not None and not isinstance(ids, list):
        raise InvalidRequestError("prompt.prompt_token_ids", f"must be a list of token ids, got {type(ids).__name__}")
    media = any(prompt.get(key) is not None and not _empty(prompt[key]) for key in ("images", "videos", "audios"))
    image_only = media and (text is None) != (ids is None)  # CLIP's image prompt: "" or [] with the image
    if bool(text) == bool(ids) and not image_only:
        why = "both 'prompt' and 'prompt_token_ids'" if text else "neither a non-empty 'prompt' nor 'prompt_token_ids'"
        raise InvalidRequestError("prompt", f"{why}: {_DICT_SHAPE}; got keys {sorted(prompt)}")
    return prompt


def _media_field(prompt: dict[str, Any]) -> str:
    """The media a text model refuses in a well-formed dict prompt: its first images, videos or audios (or their
    uuids); else its ``mm_processor_kwargs`` (`plain_prompt` takes any other well-formed dict as its plain prompt)."""
    keys = ("images", "videos", "audios", "image_uuids", "video_uuids", "audio_uuids")
    given = [key for key in keys if prompt.get(key) is not None and not _empty(prompt[key])]
    return f"prompt.{given[0] if given else 'mm_processor_kwargs'}"


def plain_prompt(prompt: dict[str, Any]) -> str | list[int] | None:
    """A prompt dict without images, videos or audios (vLLM's ``TextPrompt`` / ``TokensPrompt``: ``{"prompt": str}``,
    ``{"prompt_token_ids": [...]}``) as the plain prompt it is, for any model; None when it holds media (or is
    malformed: `multimodal_prompt` names what is wrong). A None or empty media entry is no media, and empty
    ``mm_processor_kwargs`` nothing."""
    if set(prompt) - {"prompt", "prompt_token_ids"} - MEDIA_KEYS:
        return None
    if prompt.get("mm_processor_kwargs") not in (None, {}):
        return None
    vllm_keyed = [prompt.get("multi_modal_data"), prompt.get("multi_modal_uuids")]
    if any(d is not None and (not isinstance(d, dict) or set(d) - {"image", "video", "audio"}) for d in vllm_keyed):
        return None  # `multimodal_prompt` names what is wrong: never silently a plain prompt
    values = [prompt.get(key) for key in ("images", "videos", "audios", "image_uuids", "video_uuids", "audio_uuids")]
    values += [value for given in vllm_keyed if given is not None for value in given.values()]
    if any(value is not None and not _empty(value) for value in values):
        return None  # media, or uuids of media not given
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if isinstance(text, str) and ids is None:
        return text
    if isinstance(ids, list) and text is None:
        return ids
    return None


def _empty(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict, str)) and not value


def from_vllm_prompt(prompt: dict[str, Any]) -> dict[str, Any]:
    """vLLM's prompt dict (``multi_modal_data={"image": image or [images], "video": video or [videos], "audio":
    audio or [audios]}``, ``multi_modal_uuids`` alike) as ours (``images``, ``image_uuids``, ...); ours unchanged.
    A None entry (``{"image": None}``) is none of that kind. Other modalities: `InvalidRequestError` naming them."""
    if "multi_modal_data" not in prompt and "multi_modal_uuids" not in prompt:
        return prompt
    out = {key: value for key, value in prompt.items() if key not in ("multi_modal_data", "multi_modal_uuids")}
    for key, suffix in (("multi_modal_data", "s"), ("multi_modal_uuids", "_uuids")):
        value = prompt.get(key)
        if value is None:
            continue
        if not isinstance(value, dict) or set(value) - {"image", "video", "audio"}:
            raise InvalidRequestError(f"prompt.{key}", "{'image': an image or a list, 'video': a video or a list, "
                                                       f"'audio': an audio or a list}}, got {value!r:.80}")
        for kind, given in value.items():
            if given is None:
                continue
            ours = kind + suffix
            if ours in out:
                raise InvalidRequestError(f"prompt.{key}", f"give {kind}s as {key} or as {ours!r}, not both")
            one = _IS_ONE.get(kind, _not_a_list) if suffix == "s" else _not_a_list
            out[ours] = [given] if one(given) else list(given)
    return out


def encoder_decoder_prompt(prompt: dict[str, Any], mm: MultiModalProcessor) -> dict[str, Any]:
    """vLLM's explicit prompt of an encoder-decoder model, ``{"encoder_prompt": {"prompt": "", "multi_modal_data":
    {"audio": ...}}, "decoder_prompt": str | {"prompt": str} | {"prompt_token_ids": [...]} | None}``, as the one prompt
    Whisper takes: the decoder's, holding the encoder's audio (a missing decoder prompt: the start token alone, the
    model then names the language and task itself); any other prompt unchanged."""
    if "encoder_prompt" not in prompt and "decoder_prompt" not in prompt:
        return prompt
    if mm.needs_audio is None:
        raise InvalidRequestError("prompt", "encoder_prompt / decoder_prompt are for an encoder-decoder model "
                                            "(Whisper); this model takes {'prompt': ..., 'multi_modal_data': ...}")
    encoder, decoder = prompt.get("encoder_prompt"), prompt.get("decoder_prompt")
    if set(prompt) - {"encoder_prompt", "decoder_prompt"} or not isinstance(encoder, dict) \
            or set(encoder) - {"prompt", "multi_modal_data", "multi_modal_uuids"} or encoder.get("prompt"):
        raise InvalidRequestError("prompt.encoder_prompt", "{'prompt': '', 'multi_modal_data': {'audio': ...}} beside "
                                                           "'decoder_prompt' (the encoder takes the audio alone)")
    media = {key: value for key, value in encoder.items() if key != "prompt"}
    if decoder is None:
        return {"prompt_token_ids": [mm.audio_token_id], **media}
    if isinstance(decoder, str):
        return {"prompt": decoder, **media}
    if isinstance(decoder, dict) and set(decoder) in ({"prompt"}, {"prompt_token_ids"}):
        return {**decoder, **media}
    raise InvalidRequestError("prompt.decoder_prompt", "a str, {'prompt': str}, {'prompt_token_ids': [int]} or None")


def _not_a_list(value: Any) -> bool:
    return not isinstance(value, (list, tuple))


_IS_ONE = {"video": is_one_video, "audio": is_one_audio}
"""Whether a ``multi_modal_data`` value is one input of that kind (a video's frames, an audio's samples are lists
themselves); an image or a uuid is one unless it is a list."""


def _token_ids(ids: list[Any], mm: MultiModalProcessor) -> list[int]:
    """A dict prompt's ``prompt_token_ids``, checked (the image placeholders among them, as in a text prompt)."""
    if not all(is_int(t) and 0 <= t < len(mm.tokenizer) for t in ids):
        raise InvalidRequestError("prompt.prompt_token_ids", f"token ids in [0, {len(mm.tokenizer)})")
    return list(ids)


def resend_with_data(mm: MultiModalProcessor, message: protocol.AddRequest, prompt: MultiModalPrompt) -> protocol.AddRequest:
    """The same request with every item's data, after the core reported a processor-cache miss.

    The host's half of the cache and the core's have drifted (lru), or a ring
    entry was overwritten before the core read it (shm); the request's keys are
    dropped from the host's half and the images processed and sent again, with
    their data (in shm mode inline, so that this copy cannot be overwritten).
    """
    mm.forget([item.mm_hash for item in message.mm_items])
    again = mm.process_items(prompt, inline=mm.cache_type == "shm")
    return msgspec.structs.replace(message, mm_items=again)
