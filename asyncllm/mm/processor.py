"""Host-side multimodal processing: images -> processed items, prompt -> placeholder tokens.

Runs on the processor thread (never the event loop). Each image's placeholder
token in the prompt (LLaVA's ``<image>``) is expanded to one token per feature
row its encoder outputs, so prompt positions and KV blocks cover image
features one to one; the items carry their offsets. The HF image processor is
the checkpoint's own (``AutoImageProcessor`` from the model folder). The host's
half of the processor cache is here too: the lru mirror (asyncllm/mm/cache.py)
or the shm ring's writer (asyncllm/mm/shm_ring.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.mm.host_cache import (
    HostProcessorCache,
    LruHostCache,
    ShmHostCache,
    inline_item,
)
from asyncllm.mm.images import (
    ImageInput,
    check_uuid,
    decode_image,
    load_image,
    read_image,
    uuid_key,
)
from asyncllm.mm.shm_ring import check_ring_room
from asyncllm.protocol import MultiModalItem

logger = logging.getLogger("asyncllm.mm")

__all__ = ["MultiModalProcessor", "MultiModalPrompt", "split_chat_images"]


@dataclass
class MultiModalPrompt:
    """A prompt ready for the core: expanded token ids and its items (key-only on a cache hit)."""

    token_ids: list[int]
    items: list[MultiModalItem]
    images: list[ImageInput]
    """The caller's images, kept until the core accepts the request (to resend after a cache miss)."""
    uuids: list[str | None] = dataclass_field(default_factory=list)
    """The caller's uuid of each image (None: keyed by its content hash)."""
    overrides: dict[str, Any] = dataclass_field(default_factory=dict)
    """The request's ``mm_processor_kwargs`` (over the engine's)."""


def split_chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageInput], list[str | None]]:
    """OpenAI-style messages -> (messages with ``{"type": "image"}`` parts the template renders, images, uuids).

    Image parts are ``{"type": "image", "image": ...}`` or ``{"type": "image_url",
    "image_url": {"url": ...}}``, each with an optional ``"uuid"`` (the caller's
    key for the image); URLs are refused (`load_image`), so pass bytes.
    """
    images: list[ImageInput] = []
    uuids: list[str | None] = []
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
            if kind == "image":
                images.append(part.get("image"))
            elif kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
            else:
                raise InvalidRequestError("messages", f"item {i} has a content part of unknown type {kind!r}")
            uuids.append(check_uuid(part.get("uuid"), f"messages[{i}].content[{j}].uuid"))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images, uuids


def load_image_processor(model_path: str, overrides: dict[str, Any]) -> Any:
    """The checkpoint's HF image processor with ``mm_processor_kwargs`` applied; a `ConfigError` names a key that
    changes nothing (transformers drops unknown ones without a word)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_path, **overrides)
    if overrides:
        plain = AutoImageProcessor.from_pretrained(model_path).to_dict()
        for key, value in overrides.items():
            ignored = AutoImageProcessor.from_pretrained(model_path, **{key: value}).to_dict() == plain
            if ignored and plain.get(key) != value:
                raise ConfigError(f"mm_processor_kwargs.{key}", value,
                                  f"a setting of the model's {type(processor).__name__}")
    return processor


_REQUEST_PROCESSORS = 8
"""Image processors kept for requests' distinct ``mm_processor_kwargs``."""


def overridden_key(key: str, overrides: dict[str, Any]) -> str:
    """An image's item key under a request's ``mm_processor_kwargs``: its pixels differ, so its key does too
    (processor, encoder and prefix caches); the plain key without them."""
    if not overrides:
        return key
    text = key + json.dumps(overrides, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class _Counters:
    mm_cache_queries = 0
    mm_cache_hits = 0


class MultiModalProcessor:
    """One model's image processing, placeholder expansion and the host's half of the processor cache."""

    def __init__(self, model_path: str, hf_config: Any, model_cls: Any, tokenizer: Any, cache_bytes: int,
                 max_image_pixels: int, cache_type: str = "lru", processor_kwargs: dict[str, Any] | None = None,
                 max_images: int | None = None) -> None:
        try:
            import PIL  # noqa: F401
        except ImportError as exc:
            raise ConfigError("model", model_path, "pillow installed for image inputs: pip install 'asyncllm[multimodal]'") from exc
        self._model_path = model_path
        self._engine_overrides = dict(processor_kwargs or {})
        self.image_processor = load_image_processor(model_path, self._engine_overrides)
        self._request_processors: OrderedDict[str, Any] = OrderedDict()
        """Image processors of requests' ``mm_processor_kwargs`` (by their JSON), the last few used."""
        self.tokenizer = tokenizer
        self.image_token_id: int = model_cls.mm_placeholder_token_id(hf_config)
        self._hf_config = hf_config
        self._model_cls = model_cls
        self.max_image_pixels = max_image_pixels
        self.max_images = max_images
        """``limit_mm_per_prompt["image"]``: more images in one prompt fail it before any is read (None: no limit)."""
        self.cache_type = cache_type
        self.cache_bytes = cache_bytes
        if cache_type == "shm" and cache_bytes > 0:
            check_ring_room(cache_bytes)  # before any process starts (the ring itself is made per connection)
        self.cache: HostProcessorCache | None = LruHostCache(cache_bytes) if cache_type == "lru" and cache_bytes > 0 else None
        """lru: from the start; shm: while connected to a core (`open_cache`)."""
        self.stats: Any = _Counters()
        """Where ``mm_cache_queries`` / ``mm_cache_hits`` are counted: the engine sets its HostStats."""

    # ------------------------------------------------------------ the shm ring's lifetime (processor thread)
    def open_cache(self) -> str:
        """Create the shm ring for a new connection to a core; its name for the Hello ("" unless shm)."""
        if self.cache_type != "shm" or self.cache_bytes <= 0:
            return ""
        self.close_cache()
        self.cache = ShmHostCache(self.cache_bytes)
        return self.cache.name

    def cache_mapped(self, mapped: bool) -> None:
        """The core's Ready says whether it mapped the ring: unlink its name either way (nobody else may map it)."""
        if not isinstance(self.cache, ShmHostCache):
            return
        self.cache.ring.unlink()
        if not mapped:
            logger.warning("the engine core could not map this host's shm processor cache (is it on another "
                           "machine?): images are sent with their data, uncached")
            self.close_cache()

    def close_cache(self) -> None:
        if isinstance(self.cache, ShmHostCache):
            self.cache.close()
            self.cache = None

    # ------------------------------------------------------------ prompts
    def process(self, token_ids: list[int], images: list[ImageInput], field: str,
                uuids: list[str | None] | None = None, overrides: dict[str, Any] | None = None) -> MultiModalPrompt:
        """Expand each placeholder token of ``token_ids`` and process its image (keyed by its uuid, if given;
        with the request's ``mm_processor_kwargs`` ``overrides``, by both)."""
        overrides = overrides or {}
        self._processor_for(overrides)  # a bad key fails the request before any image is read
        if not isinstance(images, (list, tuple)):
            raise InvalidRequestError(field, f"must be a list of images, got {type(images).__name__}")
        if self.max_images is not None and len(images) > self.max_images:
            raise InvalidRequestError(field, f"{len(images)} images, over limit_mm_per_prompt['image']={self.max_images}")
        uuids = uuids if uuids is not None else [None] * len(images)
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise InvalidRequestError(
                field, f"the prompt has {len(slots)} image placeholder tokens (id {self.image_token_id}) "
                f"but {len(images)} images were given: put one placeholder per image")
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        previous = 0
        for index, (slot, image, uuid) in enumerate(zip(slots, images, uuids)):
            expanded += token_ids[previous:slot]
            item = self._item(image, uuid, f"{field}[{index}]", len(expanded), overrides=overrides)
            expanded += [self.image_token_id] * item.length
            items.append(item)
            previous = slot + 1
        expanded += token_ids[previous:]
        return MultiModalPrompt(expanded, items, list(images), list(uuids), overrides)

    def process_items(self, prompt: MultiModalPrompt, inline: bool = False) -> list[MultiModalItem]:
        """``prompt``'s items again, processed from its images (``inline``: every one with its data)."""
        uuids = prompt.uuids or [None] * len(prompt.images)
        return [self._item(image, uuid, f"images[{i}]", item.offset, inline, prompt.overrides)
                for i, (image, uuid, item) in enumerate(zip(prompt.images, uuids, prompt.items))]

    def forget(self, mm_hashes: list[str]) -> None:
        """The core lacks these (drift): the next request sends their data again."""
        if self.cache is not None:
            self.cache.forget(mm_hashes)

    def _item(self, image: ImageInput, uuid: str | None, field: str, offset: int, inline: bool = False,
              overrides: dict[str, Any] | None = None) -> MultiModalItem:
        """One image's item: key-only (or a ring location) on a cache hit, else processed and recorded."""
        raw, key = (None, uuid_key(uuid)) if uuid is not None else load_image(image, field)
        key = overridden_key(key, overrides or {})
        cache = None if inline else self.cache
        if cache is not None:
            self.stats.mm_cache_queries += 1
            hit = cache.lookup(key, offset)
            if hit is not None:
                self.stats.mm_cache_hits += 1
                return hit
        decoded = decode_image(raw if raw is not None else read_image(image, field), field, self.max_image_pixels)
        pixel_values = self._preprocess(decoded, field, overrides or {})
        length = self._model_cls.mm_placeholder_length(self._hf_config, pixel_values.shape)
        if cache is None:
            return inline_item(key, offset, length, pixel_values)
        return cache.record(key, offset, length, pixel_values)

    def _processor_for(self, overrides: dict[str, Any]) -> Any:
        """The image processor with a request's ``mm_processor_kwargs`` over the engine's (`ConfigError` -> the
        request's `InvalidRequestError` for a key that changes nothing)."""
        if not overrides:
            return self.image_processor
        if not isinstance(overrides, dict):
            raise InvalidRequestError("prompt.mm_processor_kwargs", f"must be a dict, got {type(overrides).__name__}")
        name = json.dumps(overrides, sort_keys=True, default=str)
        if name not in self._request_processors:
            try:
                self._request_processors[name] = load_image_processor(self._model_path,
                                                                      {**self._engine_overrides, **overrides})
            except ConfigError as exc:
                raise InvalidRequestError("prompt.mm_processor_kwargs", f"{exc.field}={exc.value!r}: {exc.allowed}") \
                    from exc
            except (TypeError, ValueError) as exc:  # a value of the wrong type for the processor
                raise InvalidRequestError("prompt.mm_processor_kwargs", f"the image processor refused it: {exc}") \
                    from exc
            if len(self._request_processors) > _REQUEST_PROCESSORS:
                self._request_processors.popitem(last=False)
        self._request_processors.move_to_end(name)
        return self._request_processors[name]

    def _preprocess(self, image: Any, field: str, overrides: dict[str, Any]) -> Any:
        """The HF image processor's output for one image, as the model's float32 numpy array (`mm_pixel_values`)."""
        try:
            out = self._processor_for(overrides)(images=[image], return_tensors="np")
        except (ValueError, OSError) as exc:
            raise InvalidRequestError(field, f"the image processor rejected the image: {exc}") from exc
        return self._model_cls.mm_pixel_values(out)
