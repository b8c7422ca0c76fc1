"""Host-side multimodal processing: images -> processed items, prompt -> placeholder tokens.

Runs on the processor thread (never the event loop). Each image's placeholder
token in the prompt (LLaVA's ``<image>``) is expanded to one token per feature
row its encoder outputs, so prompt positions and KV blocks cover image
features one to one; the items carry their offsets. The HF image processor is
the checkpoint's own (``AutoImageProcessor`` from the model folder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.mm.cache import MirrorEntry, ProcessorCacheMirror
from asyncllm.mm.images import ImageInput, decode_image, load_image
from asyncllm.protocol import MultiModalItem

__all__ = ["MultiModalProcessor", "MultiModalPrompt", "split_chat_images"]


@dataclass
class MultiModalPrompt:
    """A prompt ready for the core: expanded token ids and its items (key-only on a cache hit)."""

    token_ids: list[int]
    items: list[MultiModalItem]
    images: list[ImageInput]
    """The caller's images, kept until the core accepts the request (to resend after a cache miss)."""


def split_chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """OpenAI-style messages -> (messages with ``{"type": "image"}`` parts the template renders, images).

    Image parts are ``{"type": "image", "image": ...}`` or ``{"type": "image_url",
    "image_url": {"url": ...}}``; URLs are refused (`load_image`), so pass bytes.
    """
    images: list[ImageInput] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind == "image":
                images.append(part.get("image"))
                parts.append({"type": "image"})
            elif kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
                parts.append({"type": "image"})
            else:
                raise InvalidRequestError("messages", f"item {i} has a content part of unknown type {kind!r}")
        out.append({**message, "content": parts})
    return out, images


class _Counters:
    mm_cache_queries = 0
    mm_cache_hits = 0


class MultiModalProcessor:
    """One model's image processing, placeholder expansion and processor-cache mirror."""

    def __init__(self, model_path: str, hf_config: Any, model_cls: Any, tokenizer: Any, cache_bytes: int,
                 max_image_pixels: int) -> None:
        try:
            import PIL  # noqa: F401
        except ImportError as exc:
            raise ConfigError("model", model_path, "pillow installed for image inputs: pip install 'asyncllm[multimodal]'") from exc
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.tokenizer = tokenizer
        self.image_token_id: int = model_cls.mm_placeholder_token_id(hf_config)
        self._hf_config = hf_config
        self._model_cls = model_cls
        self.max_image_pixels = max_image_pixels
        self.mirror = ProcessorCacheMirror(cache_bytes) if cache_bytes > 0 else None
        self.stats: Any = _Counters()
        """Where ``mm_cache_queries`` / ``mm_cache_hits`` are counted: the engine sets its HostStats."""

    def process(self, token_ids: list[int], images: list[ImageInput], field: str) -> MultiModalPrompt:
        """Expand each placeholder token of ``token_ids`` and process its image."""
        if not isinstance(images, (list, tuple)):
            raise InvalidRequestError(field, f"must be a list of images, got {type(images).__name__}")
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise InvalidRequestError(
                field, f"the prompt has {len(slots)} image placeholder tokens (id {self.image_token_id}) "
                f"but {len(images)} images were given: put one placeholder per image")
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        previous = 0
        for index, (slot, image) in enumerate(zip(slots, images)):
            expanded += token_ids[previous:slot]
            item = self._item(image, f"{field}[{index}]", len(expanded))
            expanded += [self.image_token_id] * item.length
            items.append(item)
            previous = slot + 1
        expanded += token_ids[previous:]
        return MultiModalPrompt(expanded, items, list(images))

    def process_items(self, prompt: MultiModalPrompt) -> list[MultiModalItem]:
        """``prompt``'s items again, processed from its images (with data unless the mirror has them)."""
        return [self._item(image, f"images[{i}]", item.offset) for i, (image, item) in enumerate(zip(prompt.images, prompt.items))]

    def forget(self, mm_hashes: list[str]) -> None:
        """The core lacks these (drift): the next request sends their data again."""
        if self.mirror is not None:
            for mm_hash in mm_hashes:
                self.mirror.drop(mm_hash)

    def _item(self, image: ImageInput, field: str, offset: int) -> MultiModalItem:
        raw, mm_hash = load_image(image, field)
        if self.mirror is not None:
            self.stats.mm_cache_queries += 1
            entry = self.mirror.get(mm_hash)
            if entry is not None:
                self.stats.mm_cache_hits += 1
                return MultiModalItem(mm_hash, offset, entry.length)
        pixel_values = self._preprocess(decode_image(raw, field, self.max_image_pixels), field)
        length = self._model_cls.mm_placeholder_length(self._hf_config, pixel_values.shape)
        data = pixel_values.tobytes()
        if self.mirror is not None:
            self.mirror.put(mm_hash, len(data), MirrorEntry(length))
        return MultiModalItem(mm_hash, offset, length, data, list(pixel_values.shape), str(pixel_values.dtype))

    def _preprocess(self, image: Any, field: str) -> Any:
        """The HF image processor's ``pixel_values`` of one image, as a float32 numpy array."""
        try:
            out = self.image_processor(images=[image], return_tensors="np")
        except (ValueError, OSError) as exc:
            raise InvalidRequestError(field, f"the image processor rejected the image: {exc}") from exc
        return out["pixel_values"][0].astype("float32", copy=False)
