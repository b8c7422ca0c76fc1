"""Host-side multimodal processing: images, videos and audios -> processed items, prompt -> placeholder tokens.

Runs on the processor thread (never the event loop). Each image's placeholder token in the prompt (LLaVA's
``<image>``) is expanded to one token per feature row its encoder outputs, so prompt positions and KV blocks cover
image features one to one; the items carry their offsets. The HF image processor is the checkpoint's own
(``AutoImageProcessor`` from the model folder). A video's placeholder (Qwen-VL's ``<|video_pad|>``) becomes the
tokens and items the model makes of it (``mm_video_pieces``; asyncllm/mm/qwen_video.py). An audio's (Qwen2-Audio's
``<|AUDIO|>``) becomes one token per encoder row, its features the checkpoint's feature extractor's
(``AutoFeatureExtractor``). The host's half of the processor cache is here too: the lru mirror (asyncllm/mm/cache.py)
or the shm ring's writer (asyncllm/mm/shm_ring.py). Each input's items are made by `MediaItems`
(asyncllm/mm/media_items.py); the HF processors are loaded by asyncllm/mm/hf_processors.py.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from typing import Any

from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError
from asyncllm.mm.hf_processors import load_feature_extractor, load_image_processor
from asyncllm.mm.image_bounds import check_processed_size, check_request_sizes
from asyncllm.mm.host_cache import HostProcessorCache, LruHostCache, ShmHostCache
from asyncllm.mm.inputs import MultiModalInputs, MultiModalPrompt
from asyncllm.mm.media_items import MediaItems
from asyncllm.mm.qwen_video import load_video_settings, video_grid, video_patches
from asyncllm.mm.shm_ring import check_ring_room
from asyncllm.mm.video_files import DEFAULT_NUM_FRAMES
from asyncllm.mistral_tokenizer import is_mistral, one_placeholder_each
from asyncllm.protocol import MultiModalItem
from asyncllm.tokenizer import encode_prompt

logger = logging.getLogger("asyncllm.mm")

__all__ = ["MultiModalProcessor"]

_REQUEST_PROCESSORS = 8
"""Image processors kept for requests' distinct ``mm_processor_kwargs``."""


_MISTRAL_TEXT = (" (tokenizer_mode='mistral' reads no control token from a text prompt: send a chat with media "
                 "parts, or prompt_token_ids with one placeholder id each or as mistral_common encodes them)")


def _input_field(locations: dict[str, list[str]], fields: dict[str, str], kind: str, index: int) -> str:
    """Input ``index`` of ``kind`` as its errors name it: where a chat gave it (``messages[i].content[j]``), else
    by its index (``prompt.images[0]``)."""
    located = locations.get(kind)
    return located[index] if located else f"{fields[kind]}[{index}]"


class _Counters:
    mm_cache_queries = 0
    mm_cache_hits = 0


class MultiModalProcessor(MediaItems):
    """One model's image processing, placeholder expansion and the host's half of the processor cache (each input's
    items: `MediaItems`, asyncllm/mm/media_items.py)."""

    def __init__(self, model_path: str, hf_config: Any, model_cls: Any, tokenizer: Any, cache_bytes: int,
                 max_image_pixels: int, cache_type: str = "lru", processor_kwargs: dict[str, Any] | None = None,
                 max_images: int | None = None, max_videos: int | None = None, video_num_frames: int = DEFAULT_NUM_FRAMES,
                 max_audios: int | None = None) -> None:
        takes_images = getattr(model_cls, "mm_takes_images", True)  # Qwen2-Audio: audio only
        self._not_built: dict[str, str] = getattr(model_cls, "mm_not_built", {})
        """Kinds whose encoder the checkpoint has but asyncllm does not build (Gemma 3n's images): the encoder's name.
        A limit above 0 is a `NotBuiltError`, an input of that kind fails its request, each naming it."""
        if max_images and "image" in self._not_built:
            raise NotBuiltError("limit_mm_per_prompt.image", max_images, f"image input ({self._not_built['image']})")
        if takes_images:
            try:
                import PIL  # noqa: F401
            except ImportError as exc:
                raise ConfigError("model", model_path, "pillow installed for image inputs: pip install 'asyncllm[multimodal]'") from exc
        elif processor_kwargs:
            raise ConfigError("mm_processor_kwargs", processor_kwargs, f"None: {model_cls.__name__} has no image "
                                                                       "processor (its audio features follow the checkpoint)")
        self._model_path = model_path
        self._check_kwargs = getattr(model_cls, "mm_check_processor_kwargs", None)
        """The model's refusal of processor settings it does not build (Qwen-Omni's ``enable_audio_output``)."""
        if self._check_kwargs is not None:
            self._check_kwargs(processor_kwargs or {})
        self._own_kwargs: tuple[str, ...] = getattr(model_cls, "mm_own_processor_kwargs", ())
        """``mm_processor_kwargs`` the model's processing here reads (Qwen-Omni's ``use_audio_in_video``), kept
        from its image processor."""
        self._engine_overrides = {k: v for k, v in (processor_kwargs or {}).items() if k not in self._own_kwargs}
        self._engine_own = {k: v for k, v in (processor_kwargs or {}).items() if k in self._own_kwargs}
        if not isinstance(self._engine_own.get("use_audio_in_video", False), bool):
            raise ConfigError("mm_processor_kwargs.use_audio_in_video", self._engine_own["use_audio_in_video"],
                              "true or false")
        self._processor_defaults: dict[str, Any] = getattr(model_cls, "mm_processor_defaults", {})
        """Image processor settings the model's HF processor passes where the image processor has none."""
        self._processor_cls = getattr(model_cls, "mm_image_processor_class", None)
        """The model's own image processor class (None: ``AutoImageProcessor``)."""
        self._check_image_processor = getattr(model_cls, "mm_check_image_processor", None)
        """The model's `ConfigError` for image processor settings its config contradicts (Command A Vision's
        tokens per tile); run on the engine's processor and on each request's."""
        self.image_processor = (load_image_processor(model_path, self._engine_overrides, self._processor_defaults,
                                                     self._processor_cls) if takes_images else None)
        if self._check_image_processor is not None and self.image_processor is not None:
            self._check_image_processor(hf_config, self.image_processor)
        self._request_processors: OrderedDict[str, Any] = OrderedDict()
        """Image processors of requests' ``mm_processor_kwargs`` (by their JSON), the last few used."""
        self.tokenizer = tokenizer
        token_of = getattr(model_cls, "mm_placeholder_token_of", None)  # Aya Vision: its tokenizer's <image>
        self.image_token_id: int | None = None if not takes_images else (
            token_of(hf_config, tokenizer) if token_of else model_cls.mm_placeholder_token_id(hf_config))
        """The prompt token that marks an image; None: the model takes no images."""
        placeholder = getattr(model_cls, "mm_image_placeholder_id", None)
        self.image_placeholder_id = placeholder(hf_config) if placeholder is not None else self.image_token_id
        """The token an image's placeholders are: its marker's, or the model's (Gemma 3's ``<image_soft_token>``,
        Aya Vision's ``<|IMG_PATCH|>``, Llama 4's ``<|patch|>``, each after a marker of its own)."""
        image_text = getattr(model_cls, "mm_image_text", None)
        self._image_text: tuple[list[int], list[int]] = image_text(hf_config, tokenizer) if image_text else ([], [])
        """Text tokens before and after each image's rows (Gemma 3's ``\n\n<start_of_image>`` ...)."""
        merges = getattr(model_cls, "mm_token_merges", None)
        self._merges: dict[tuple[int, int], int] = merges(tokenizer) if merges else {}
        """Token pairs that become one token where that text meets the prompt's (Gemma 3's newline runs)."""
        bidirectional = getattr(model_cls, "mm_bidirectional", False)  # Gemma 4: as its config says
        self._bidirectional = bool(bidirectional(hf_config) if callable(bidirectional) else bidirectional)
        """Whether an image's rows attend to each other both ways (`MultiModalItem.bidirectional`)."""
        self._prompt_items = getattr(model_cls, "mm_prompt_items", None)
        """The model's items of a whole prompt around its media's (PaliGemma's prefix span); None: the media's."""
        self.marks_text_prompts = self._prompt_items is not None
        """Whether a prompt without media has items too (`process` makes them)."""
        self._image_pieces = getattr(model_cls, "mm_image_pieces", None)
        """An image as several items with text between them (Idefics3's tiles); None: one item per image."""
        self._layouts: OrderedDict[str, list[Any]] = OrderedDict()
        """Such an image's pieces by its key, the last `_LAYOUTS` images' (what its processing decided)."""
        call_kwargs = getattr(model_cls, "mm_processor_call_kwargs", None)
        self._call_kwargs: dict[str, Any] = call_kwargs(hf_config) if call_kwargs is not None else {}
        """What the model's HF processor passes its image processor per call (Mistral 3's patch size)."""
        self._hf_config = hf_config
        self._model_cls = model_cls
        self.max_image_pixels = max_image_pixels
        self.max_images = max_images
        """``limit_mm_per_prompt["image"]``: more images in one prompt fail it before any is read (None: no limit)."""
        self._image_prompt = getattr(model_cls, "mm_image_prompt", None)  # CLIP's: text or one image per prompt
        self.max_videos = max_videos
        """``limit_mm_per_prompt["video"]``."""
        self.video_num_frames = video_num_frames
        """Frames sampled from an encoded video file (``media_io_kwargs``)."""
        video_token = getattr(model_cls, "mm_video_token_id", None)
        self.video_token_id: int | None = video_token(hf_config) if video_token is not None else None
        """The prompt token that marks a video; None: the model takes no videos."""
        placeholder = getattr(model_cls, "mm_video_placeholder_id", None)
        self.video_placeholder_id = placeholder(hf_config) if placeholder is not None else self.video_token_id
        """The token a video's placeholders are: its marker's, or the model's (GLM: ``<|image|>`` runs per frame)."""
        processing = getattr(model_cls, "mm_video_processing", None)
        """The model's own frame processing (LLaVA-NeXT-Video: asyncllm/mm/llava_video.py); None: Qwen-VL's."""
        self._video_grid = processing.grid if processing is not None else video_grid
        self._video_patches = processing.patches if processing is not None else video_patches
        self.video_settings = None if self.video_token_id is None else (
            processing.load(model_path, hf_config) if processing is not None
            else load_video_settings(model_path, model_cls.video_settings))
        audio_token = getattr(model_cls, "mm_audio_token_id", None)
        self.audio_token_id: int | None = audio_token(hf_config) if audio_token is not None else None
        """The prompt token that marks an audio; None: the model takes no audio."""
        if max_audios and self.audio_token_id is None:  # Gemma 4: its checkpoints without an audio tower
            raise ConfigError("limit_mm_per_prompt.audio", max_audios, f"0: this {model_cls.__name__} checkpoint "
                                                                       "has no audio tower")
        audio_text = getattr(model_cls, "mm_audio_text", None)
        self._audio_text: tuple[list[int], list[int]] = audio_text(hf_config, tokenizer) if audio_text else ([], [])
        """Tokens before and after each audio's placeholders (Gemma 4's ``<|audio>`` ... ``<audio|>``)."""
        self.max_audios = max_audios
        """``limit_mm_per_prompt["audio"]``."""
        extractor_cls = getattr(model_cls, "mm_feature_extractor_class", None)  # None: AutoFeatureExtractor
        self.feature_extractor = (load_feature_extractor(model_path, extractor_cls)
                                  if self.audio_token_id is not None else None)
        self.prompt_special_tokens = bool(getattr(model_cls, "mm_prompt_special_tokens", True))
        """Whether a text prompt is tokenized with the tokenizer's special tokens (Whisper's decoder prompt: not)."""
        self.needs_audio: str | None = None if not getattr(model_cls, "mm_cross_attention", False) else (
            f"one audio and a prompt that starts the transcript with its <|startoftranscript|> token (id "
            f"{self.audio_token_id}): {model_cls.__name__} transcribes one audio per prompt, e.g. {{'prompt': "
            "'<|startoftranscript|><|en|><|transcribe|><|notimestamps|>', 'multi_modal_data': {'audio': (waveform, "
            "rate)}}")
        """What a prompt must hold for an encoder-decoder model (Whisper), which cannot run without its audio; None:
        any prompt."""
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
    def process(self, token_ids: list[int], inputs: MultiModalInputs, field: str,
                overrides: dict[str, Any] | None = None, inline: bool = False) -> MultiModalPrompt:
        """Expand each image's and video's placeholder token of ``token_ids`` and process its input (keyed by its
        uuid, if given; an image with the request's ``mm_processor_kwargs`` ``overrides`` by both). ``field`` names
        the images (their videos: ``...videos``); ``inline``: every item with its data, the cache untouched."""
        overrides = request_kwargs = overrides or {}
        self._processor_for(overrides)  # a bad key fails the request before any image is read
        if self._image_prompt is not None and isinstance(inputs.images, (list, tuple)) and inputs.images:
            token_ids = self._image_prompt(self.tokenizer, token_ids, inputs.images)
        written = token_ids  # mistral_common's rows of each image (its encoding, vLLM's prompts): one placeholder each
        token_ids = one_placeholder_each(self.tokenizer, token_ids) if is_mistral(self.tokenizer) else token_ids
        with_audio = {**self._engine_own, **overrides}.get("use_audio_in_video", False)
        """Each video takes the next audio (its track), interleaved with its frames (`_video_with_audio`)."""
        if "use_audio_in_video" in self._own_kwargs and not isinstance(with_audio, bool):
            raise InvalidRequestError("prompt.mm_processor_kwargs.use_audio_in_video", f"true or false, got "
                                                                                        f"{with_audio!r}")
        with_audio = "use_audio_in_video" in self._own_kwargs and with_audio
        overrides = {k: v for k, v in overrides.items() if k not in self._own_kwargs}  # not in the images' keys
        fields = {kind: field.removesuffix("images") + kind + "s" if field.endswith("images") else field
                  for kind in ("image", "video", "audio")}
        where = functools.partial(_input_field, inputs.locations or {}, fields)
        token_of = self._markers()
        limits = {"image": self.max_images, "video": self.max_videos, "audio": self.max_audios}
        media = {kind: self._checked(getattr(inputs, kind + "s"), getattr(inputs, kind + "_uuids"), fields[kind], kind,
                                     limits[kind]) for kind in token_of}
        tokens = {token: kind for kind, token in token_of.items() if token is not None}
        scanned = inputs.images or self._image_prompt is None  # an image-only model's text has no placeholder
        slots = [(i, tokens[t]) for i, t in enumerate(token_ids) if t in tokens] if scanned else []
        for kind, (given, _) in media.items():
            count = sum(1 for _, k in slots if k == kind or with_audio and kind == "audio" and k == "video")
            if count != len(given):
                raise InvalidRequestError(
                    fields[kind], f"the prompt has {count} {kind} placeholder tokens (id {token_of[kind]}) but "
                                  f"{len(given)} {kind}s were given: put one placeholder per {kind}"
                                  + (_MISTRAL_TEXT if is_mistral(self.tokenizer) else ""))
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        uuids: list[tuple[str, str] | None] = []  # per item: its input's field and uuid (`MultiModalPrompt.uuids`)
        previous, seen = 0, {"image": 0, "video": 0, "audio": 0}
        before, after = self._image_text
        for slot, kind in slots:
            self._join(expanded, token_ids[previous:slot])
            index, seen[kind] = seen[kind], seen[kind] + 1
            value, uuid = media[kind][0][index], media[kind][1][index]
            if kind == "image" and self._tiled(overrides):
                self._tiled_image(value, uuid, where(kind, index), expanded, items, inline, overrides)
            elif kind == "image":
                self._join(expanded, before)
                item = self._marked(self._item(value, uuid, where(kind, index), len(expanded), inline, overrides))
                expanded += self._placeholder_ids(item) + after
                items.append(item)
            elif kind == "audio":
                self._audio(value, uuid, where(kind, index), expanded, items, inline, bool(media["image"][0]))
            elif with_audio:
                track, seen["audio"] = seen["audio"], seen["audio"] + 1
                self._video_with_audio((value, uuid, where(kind, index)), (*(m[track] for m in media["audio"]),
                                       where("audio", track)), token_ids[slot + 1 : slot + 2], expanded, items, inline)
            else:
                self._video(value, uuid, where(kind, index), expanded, items, inline)
            owned = uuid is not None and not (with_audio and kind == "video")  # a video's items hold its track's too
            uuids += [(where(kind, index), uuid) if owned else None] * (len(items) - len(uuids))
            previous = slot + 1
        self._join(expanded, token_ids[previous:])
        if token_ids is not written and expanded != list(written):
            raise InvalidRequestError("prompt_token_ids", "media rows as mistral_common wrote them, and they differ "
                                                          "from this engine's for those inputs: give one placeholder "
                                                          "id each, which the engine expands")
        if self.needs_audio is not None and len(items) != 1:
            raise InvalidRequestError(fields["audio"], f"{len(items)} audios; the model takes {self.needs_audio}")
        if self._prompt_items is not None:
            items, uuids = self._prompt_items(self._hf_config, expanded, items), []
        return MultiModalPrompt(expanded, items, inputs, list(token_ids), request_kwargs, uuids)  # all: replayed

    def encode_text(self, text: str, num_images: int) -> list[int]:
        """A dict prompt's text as token ids: the tokenizer's, or of the text the model's processor writes around
        it (``mm_prompt_text``: PaliGemma's ``<image>`` rows, ``<bos>`` and newline), its own tokens only."""
        layout = getattr(self._model_cls, "mm_prompt_text", None)
        if layout is None:
            return encode_prompt(self.tokenizer, text, self.prompt_special_tokens)
        return encode_prompt(self.tokenizer, layout(self.tokenizer, text, num_images), False)

    def placeholder_text(self, kind: str) -> str:
        """One `kind` ("image", "video", "audio") as a ``"string"`` chat content writes it (vLLM's placeholder string):
        its marker token, between the model's start and end tokens where it names them (``mm_placeholder_around``:
        Qwen-VL's ``<|vision_start|><|image_pad|><|vision_end|>``)."""
        marker = self._markers()[kind]
        if marker is None:
            raise InvalidRequestError("messages", f"{self._model_cls.__name__} takes no {kind}s")
        if getattr(self._model_cls, "mm_image_prompt", None) is not None:
            return ""  # CLIP's: no placeholder text (vLLM's None), an image chat's text is the template's alone
        if not getattr(self._model_cls, "mm_string_placeholder", True):
            raise InvalidRequestError("chat_template_content_format", f"'string' with {kind} parts is not built for "
                                      f"{self._model_cls.__name__} (vLLM writes its own placeholder text there, "
                                      "numbered or with other tokens); use 'openai' or 'auto', or give a prompt with "
                                      "the placeholders")
        names = getattr(self._model_cls, "mm_placeholder_around", {}).get(kind, ())
        around = [getattr(self._hf_config, name, None) for name in names]
        ids = [around[0], marker, around[1]] if len(around) == 2 and None not in around else [marker]
        return "".join(self.tokenizer.convert_ids_to_tokens([int(i) for i in ids]))

    def _tiled(self, overrides: dict[str, Any]) -> bool:
        """Whether an image becomes several items (`mm_image_pieces`): always for Idefics3's tiles, for Gemma 3 when
        its image processor (with ``overrides``) pans and scans (the model's ``mm_image_tiled``)."""
        if self._image_pieces is None:
            return False
        tiled = getattr(self._model_cls, "mm_image_tiled", None)
        return tiled is None or bool(tiled(self._processor_for(overrides)))

    def _markers(self) -> dict[str, int | None]:
        """Each kind's placeholder token (None: the model takes none of that kind)."""
        return {"image": self.image_token_id, "video": self.video_token_id, "audio": self.audio_token_id}

    def _checked(self, given: Any, uuids: list[str | None] | None, field: str, kind: str,
                 limit: int | None) -> tuple[list[Any], list[str | None]]:
        """A prompt's inputs of one kind and their uuids, checked against ``limit_mm_per_prompt``."""
        if not isinstance(given, (list, tuple)):
            raise InvalidRequestError(field, f"must be a list of {kind}s, got {type(given).__name__}")
        if given and kind in self._not_built:
            raise InvalidRequestError(field, f"{len(given)} {kind}s, but {self._not_built[kind]} is not built yet in "
                                             f"asyncllm ({self._model_cls.__name__} serves the other kinds)")
        if given and self._markers()[kind] is None:
            raise InvalidRequestError(field, f"{self._model_cls.__name__} takes no {kind}s")
        if limit is not None and len(given) > limit:
            raise InvalidRequestError(field, f"{len(given)} {kind}s, over limit_mm_per_prompt[{kind!r}]={limit}")
        return list(given), list(uuids) if uuids is not None else [None] * len(given)

    def process_items(self, prompt: MultiModalPrompt, inline: bool = False) -> list[MultiModalItem]:
        """``prompt``'s items again, processed from its inputs (``inline``: every one with its data)."""
        return self.process(prompt.prompt_token_ids, prompt.inputs, "prompt.images", prompt.overrides, inline).items

    def forget(self, mm_hashes: list[str]) -> None:
        """The core lacks these (drift): the next request sends their data again."""
        if self.cache is not None:
            self.cache.forget(mm_hashes)


    def _processor_for(self, overrides: dict[str, Any]) -> Any:
        """The image processor with a request's ``mm_processor_kwargs`` over the engine's (`ConfigError` -> the
        request's `InvalidRequestError` for a key that changes nothing)."""
        if isinstance(overrides, dict) and self._own_kwargs:
            overrides = {k: v for k, v in overrides.items() if k not in self._own_kwargs}
        if not overrides:
            return self.image_processor
        if self.image_processor is None:
            raise InvalidRequestError("prompt.mm_processor_kwargs", f"{self._model_cls.__name__} has no image "
                                                                    "processor to override")
        if not isinstance(overrides, dict):
            raise InvalidRequestError("prompt.mm_processor_kwargs", f"must be a dict, got {type(overrides).__name__}")
        name = json.dumps(overrides, sort_keys=True, default=str)
        if name not in self._request_processors:
            try:
                if self._check_kwargs is not None:
                    self._check_kwargs(overrides)
                processor = load_image_processor(self._model_path, {**self._engine_overrides, **overrides},
                                                 self._processor_defaults, self._processor_cls)
                if self._check_image_processor is not None:
                    self._check_image_processor(self._hf_config, processor)
                check_request_sizes(self.image_processor.to_dict(), processor.to_dict(), overrides,
                                    self.max_image_pixels)
                self._request_processors[name] = processor
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
        return self._model_cls.mm_pixel_values(self._processor_output(image, field, overrides))

    def _processor_output(self, image: Any, field: str, overrides: dict[str, Any]) -> Any:
        """The HF image processor's output for one image."""
        processor = self._processor_for(overrides)
        check_processed_size(processor, image.size, field, self.max_image_pixels)
        try:
            return processor(images=[image], return_tensors="np", **self._call_kwargs)
        except (ValueError, OSError, TypeError) as exc:  # TypeError: a request's setting of the wrong type
            raise InvalidRequestError(field, f"the image processor rejected the image: {exc}") from exc
