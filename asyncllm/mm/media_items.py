"""`MediaItems`: how `MultiModalProcessor` (asyncllm/mm/processor.py) turns one image, video or audio into its
items and placeholder tokens, a mixin. Each input is looked up in the host's half of the processor cache by its key
(content hash or uuid, and the request's ``mm_processor_kwargs``) and read and processed only on a miss: an image as
one item or as its tiles between text (``mm_image_pieces``), a video as the pieces the model makes of it
(``mm_video_pieces``), interleaved with its audio track for ``use_audio_in_video``, an audio as one item of its
features."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec

from asyncllm.errors import InvalidRequestError
from asyncllm.mm.audios import AudioInput, read_audio
from asyncllm.mm.host_cache import HostProcessorCache, inline_item
from asyncllm.mm.images import (
    ImageInput,
    decode_image,
    load_image,
    read_image,
    uuid_key,
)
from asyncllm.mm.videos import VideoInput, read_video
from asyncllm.protocol import MultiModalItem

__all__ = ["MediaItems", "overridden_key"]


_LAYOUTS = 4096
"""Tiled images whose layout (`mm_image_pieces`) the processor keeps, so a repeat needs no processing."""


def overridden_key(key: str, overrides: dict[str, Any]) -> str:
    """An image's item key under a request's ``mm_processor_kwargs``: its pixels differ, so its key does too
    (processor, encoder and prefix caches); the plain key without them."""
    if not overrides:
        return key
    text = key + json.dumps(overrides, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()



class MediaItems:
    """Mixin of `MultiModalProcessor`: one input's items, appended with its placeholder tokens to a prompt's."""

    _hf_config: Any
    _model_cls: Any
    tokenizer: Any
    image_placeholder_id: int | None
    video_placeholder_id: int | None
    audio_token_id: int | None
    max_image_pixels: int
    video_num_frames: int
    video_settings: Any
    feature_extractor: Any
    cache: HostProcessorCache | None
    stats: Any
    _video_grid: Any
    _video_patches: Any
    _audio_text: tuple[list[int], list[int]]
    _merges: dict[tuple[int, int], int]
    _bidirectional: bool
    _image_pieces: Any
    _layouts: OrderedDict[str, list[Any]]

    if TYPE_CHECKING:
        def _preprocess(self, image: Any, field: str, overrides: dict[str, Any]) -> Any: ...

        def _processor_output(self, image: Any, field: str, overrides: dict[str, Any]) -> Any: ...

    def _join(self, expanded: list[int], tokens: list[int]) -> None:
        """Append ``tokens`` to ``expanded``, the two tokens at the seam merged when the model says they make one
        (``mm_token_merges``: Gemma 3's ``"\n"`` before its ``"\n\n<start_of_image>"`` is one ``"\n\n\n"``, as
        its tokenizer reads the text its processor writes). Only text meets at these seams."""
        if self._merges and expanded and tokens and (expanded[-1], tokens[0]) in self._merges:
            expanded[-1] = self._merges[(expanded[-1], tokens[0])]
            tokens = tokens[1:]
        expanded += tokens

    def _marked(self, item: MultiModalItem) -> MultiModalItem:
        """``item`` with its rows marked to attend to each other both ways, if the model's images' do."""
        return msgspec.structs.replace(item, bidirectional=[0, item.length]) if self._bidirectional else item

    def _placeholder_ids(self, item: MultiModalItem) -> list[int]:
        """An image's placeholder tokens: the model's layout (``mm_placeholder_ids``: Mistral 3's rows), else one
        placeholder token per feature row (`image_placeholder_id`)."""
        layout = getattr(self._model_cls, "mm_placeholder_ids", None)
        if layout is None:
            return [self.image_placeholder_id] * item.length
        return layout(self._hf_config, self.tokenizer, tuple(item.shape))

    def _item(self, image: ImageInput, uuid: str | None, field: str, offset: int, inline: bool = False,
              overrides: dict[str, Any] | None = None) -> MultiModalItem:
        """One image's item: key-only (or a ring location) on a cache hit, else processed and recorded."""
        raw, key = (None, uuid_key(uuid)) if uuid is not None else load_image(image, field, self.max_image_pixels)
        key = overridden_key(key, overrides or {})
        hit = self._lookup(key, offset, inline)
        if hit is not None:
            return hit
        decoded = decode_image(raw if raw is not None else read_image(image, field), field, self.max_image_pixels)
        return self._record(key, offset, self._preprocess(decoded, field, overrides or {}), inline)

    def _tiled_image(self, image: ImageInput, uuid: str | None, field: str, expanded: list[int],
                     items: list[MultiModalItem], inline: bool, overrides: dict[str, Any]) -> None:
        """Append an image's pieces (the model's ``mm_image_pieces``: text, one item's placeholders, text) to
        ``expanded`` and ``items``. The layout comes from the processor's output and is kept by the image's key
        (`_layouts`): an image seen before whose pieces the core still holds is not decoded nor processed again,
        its pieces cross as keys."""
        raw, key = (None, uuid_key(uuid)) if uuid is not None else load_image(image, field, self.max_image_pixels)
        key = overridden_key(key, overrides)
        tiles = None

        def process() -> Any:
            decoded = decode_image(raw if raw is not None else read_image(image, field), field, self.max_image_pixels)
            return self._processor_output(decoded, field, overrides)

        pieces = self._layouts.get(key)
        if pieces is None:
            processed = process()
            tiles = self._model_cls.mm_pixel_values(processed)
            pieces = self._image_pieces(self._hf_config, self.tokenizer, processed)
            self._layouts[key] = pieces
            if len(self._layouts) > _LAYOUTS:
                self._layouts.popitem(last=False)
        self._layouts.move_to_end(key)
        for index, piece in enumerate(pieces):
            self._join(expanded, piece.before)
            piece_key = overridden_key(key, {"piece": index})
            item = self._lookup(piece_key, len(expanded), inline)
            if item is None:
                tiles = self._model_cls.mm_pixel_values(process()) if tiles is None else tiles
                item = self._record(piece_key, len(expanded), tiles[piece.frames], inline)
            item = self._marked(item)
            items.append(item)
            expanded += self._placeholder_ids(item) + piece.after

    def _video(self, value: VideoInput, uuid: str | None, field: str, expanded: list[int],
               items: list[MultiModalItem], inline: bool) -> None:
        """Append a video's tokens to ``expanded`` and its items (one per piece the model makes of it) to ``items``;
        its frames are processed once, and only when some piece misses the cache."""
        video = read_video(value, field, self.max_image_pixels, self.video_num_frames)
        grid = self._video_grid(video, self.video_settings, field)
        pieces = self._model_cls.mm_video_pieces(self._hf_config, self.tokenizer, video, grid)
        key = uuid_key(uuid) if uuid is not None else video.key()
        patches = None
        for index, piece in enumerate(pieces):
            expanded += piece.before
            piece_key = key if len(pieces) == 1 else overridden_key(key, {"piece": index})
            item = self._lookup(piece_key, len(expanded), inline)
            if item is None:
                patches = self._video_patches(video, self.video_settings, field) if patches is None else patches
                item = self._record(piece_key, len(expanded), patches[piece.frames], inline)
            if piece.time_interval != 1.0:
                item = msgspec.structs.replace(item, time_interval=piece.time_interval)
            items.append(item)
            expanded += [self.video_placeholder_id] * item.length + piece.after

    def _video_with_audio(self, video: tuple[VideoInput, str | None, str], audio: tuple[AudioInput, str | None, str],
                          following: list[int], expanded: list[int], items: list[MultiModalItem], inline: bool) -> None:
        """Append a video interleaved with its audio track (``use_audio_in_video``: the model's
        ``mm_audio_in_video``, asyncllm/models/omni_interleave.py): each run of placeholders one item, a piece of
        the whole video's or audio's rows (both processed, cached and encoded once)."""
        spec = self._model_cls.mm_audio_in_video(self._hf_config)
        vision_end = self.tokenizer.convert_tokens_to_ids(spec.vision_end_token)
        if expanded[-1:] != [spec.vision_start] or following != [vision_end]:
            raise InvalidRequestError(video[2], f"with use_audio_in_video a video's placeholder follows its vision "
                                                f"start token (id {spec.vision_start}) and precedes its end token "
                                                f"({spec.vision_end_token}, id {vision_end})")
        whole: list[MultiModalItem] = []
        self._video(*video, [], whole, inline)
        self._audio(*audio, [], whole, inline)
        try:
            pieces = spec.pieces(tuple(whole[0].shape[:3]), whole[0].time_interval, whole[1].length)
        except ValueError as exc:  # a layout the model's positions cannot take (Qwen3-Omni's fractional times)
            raise InvalidRequestError(video[2], str(exc)) from exc
        expanded.append(spec.audio_start)
        for is_video, start, stop in pieces:
            item = whole[0] if is_video else whole[1]
            data = {} if start == 0 else {"data": None, "shm_offset": -1, "shm_generation": 0}  # key-only: the first's
            items.append(msgspec.structs.replace(item, offset=len(expanded), length=stop - start,
                                                 rows=[start, item.length], **data))
            expanded += [self.video_placeholder_id if is_video else self.audio_token_id] * (stop - start)
        expanded.append(spec.audio_end)

    def _audio(self, value: AudioInput, uuid: str | None, field: str, expanded: list[int],
               items: list[MultiModalItem], inline: bool, with_images: bool = False) -> None:
        """Append an audio's placeholders to ``expanded`` and its item to ``items``; it is read and its features
        extracted only on a cache miss when the caller keys it by uuid. ``with_images``: the prompt holds images
        too, which a model's ``mm_audio_with_images`` marks in the audio's values (and so in its key: Phi-4-multimodal
        projects such an audio's rows with other weights)."""
        rate = int(self.feature_extractor.sampling_rate)
        before, after = self._audio_text
        self._join(expanded, before)
        audio = None if uuid is not None else read_audio(value, field, rate)
        key = uuid_key(uuid) if audio is None else audio.key()
        mark = getattr(self._model_cls, "mm_audio_with_images", None)
        key = overridden_key(key, {"with_images": True}) if mark is not None and with_images else key
        item = self._lookup(key, len(expanded), inline)
        if item is None:
            audio = audio or read_audio(value, field, rate)
            processed = self.feature_extractor(self._model_cls.mm_audio_windows(audio.waveform, rate),
                                               sampling_rate=rate, return_tensors="np",
                                               **self._model_cls.mm_audio_extractor_kwargs)
            values = self._model_cls.mm_audio_values(processed)
            values = mark(values, with_images) if mark is not None else values
            length = self._length(values)
            if length == 0:  # under one encoder row (~30 ms for Qwen2-Audio): refused before it takes
                # a cache slot (so none is ever a hit); vLLM's words
                raise InvalidRequestError(field, f"the audio (len={audio.waveform.size}) is too short to be "
                                                 f"represented inside the model")
            item = self._record(key, len(expanded), values, inline, length)
        items.append(item)
        expanded += [self.audio_token_id] * item.length + after

    def _lookup(self, key: str, offset: int, inline: bool) -> MultiModalItem | None:
        """The cached item of ``key`` (key-only or a ring location), counted; None on a miss or ``inline``."""
        if inline or self.cache is None:
            return None
        self.stats.mm_cache_queries += 1
        hit = self.cache.lookup(key, offset)
        if hit is not None:
            self.stats.mm_cache_hits += 1
        return hit

    def _record(self, key: str, offset: int, pixel_values: Any, inline: bool,
                length: int | None = None) -> MultiModalItem:
        """A processed item, recorded in the cache unless ``inline``; `length`: its rows, when already counted."""
        length = self._length(pixel_values) if length is None else length
        if inline or self.cache is None:
            return inline_item(key, offset, length, pixel_values)
        return self.cache.record(key, offset, length, pixel_values)

    def _length(self, pixel_values: Any) -> int:
        """A processed item's placeholder count."""
        length_of = getattr(self._model_cls, "mm_placeholder_length_of", None)  # lengths that need the values
        return (length_of(self._hf_config, pixel_values) if length_of is not None
                else self._model_cls.mm_placeholder_length(self._hf_config, pixel_values.shape))
