"""``tokenizer_mode="mistral"``: Mistral's own tokenizer files (``tekken.json``, ``tokenizer.model.v3``...) read by
mistral_common, through transformers' `MistralCommonBackend` (a `PreTrainedTokenizerBase`, so prompts, decoding,
stop strings and logprobs take it as any tokenizer).

What differs from a Hugging Face tokenizer, and is handled here:

- chat: mistral_common encodes the conversation to ids itself (its control tokens are never parsed out of text),
  so a chat renders to a `MistralChat`, the ids with their decoded text (for ``max_prompt_chars``), not to text
  that is tokenized again. There is no Jinja template: a request's ``chat_template`` or template variables are
  refused by name.
- transcription (Voxtral): the prompt is what mistral_common encodes for a transcription request
  (`render_mistral_transcription`; asyncllm/speech.py serves it).
- structured outputs: xgrammar gets the vocabulary as mistral_common spells it (`xgrammar_vocab`).
- ``auto`` picks this mode for a folder with a Mistral tokenizer file and no Hugging Face one
  (`uses_mistral`); docs/tokenizers.md.
"""

from __future__ import annotations

import base64
import functools
import io
import os
import re
import wave
from typing import TYPE_CHECKING, Any

from asyncllm.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["MistralChat", "MEDIA_ARCHITECTURES", "encodes_media", "uses_mistral", "load_mistral_tokenizer",
           "is_mistral", "mistral_transcribes", "one_placeholder_each", "render_mistral_chat",
           "render_mistral_transcription", "xgrammar_vocab"]

_MISTRAL_FILE = re.compile(r"tekken\.json|tokenizer(\.mm)?\.model\.v\d+(m\d+)?")
"""Tokenizer files only Mistral's checkpoints ship (a bare ``tokenizer.model`` is any sentencepiece model's)."""

_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

_CHAT_KWARGS = frozenset({"add_generation_prompt", "continue_final_message", "reasoning_effort"})
"""The request's template variables mistral_common's chat encoding takes."""

INSTALL_HINT = "pip install 'asyncllm[mistral]' (mistral_common)"

AUDIO_TOKEN = "[AUDIO]"
MEDIA_ARCHITECTURES = ("VoxtralForConditionalGeneration", "Mistral3ForConditionalGeneration")
"""The models with media whose chats mistral_common encodes here (their media parts: `_with_stand_ins`), with LLaVA
over a Pixtral tower (Pixtral-12B: `encodes_media`)."""


class MistralChat(str):
    """A chat mistral_common encoded: the text is its ids decoded (control tokens kept), `token_ids` the ids."""

    token_ids: list[int]

    def __new__(cls, text: str, token_ids: list[int]) -> MistralChat:
        chat = super().__new__(cls, text)
        chat.token_ids = token_ids
        return chat


def encodes_media(arch: str, hf_config: Any) -> bool:
    """Whether mistral_common encodes the chats of ``arch`` with their media: Voxtral's audio, Pixtral's images
    (Mistral 3, and LLaVA with a Pixtral tower: Pixtral-12B)."""
    if arch == "LlavaForConditionalGeneration":
        return getattr(getattr(hf_config, "vision_config", None), "model_type", None) == "pixtral"
    return arch in MEDIA_ARCHITECTURES


def uses_mistral(name_or_path: str, mode: str) -> bool:
    """Whether the tokenizer loads with mistral_common: ``mode`` "mistral", or "auto" for a local folder holding a
    Mistral tokenizer file (``tekken.json``, ``tokenizer.model.v<N>``) and none of Hugging Face's."""
    if mode == "mistral":
        return True
    if mode != "auto" or not os.path.isdir(name_or_path):
        return False
    files = os.listdir(name_or_path)
    return any(_MISTRAL_FILE.fullmatch(name) for name in files) and not any(name in files for name in _HF_FILES)


def load_mistral_tokenizer(name_or_path: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    """The folder's (or hub id's) Mistral tokenizer as transformers' `MistralCommonBackend`; a `ConfigError` when
    mistral_common is not installed or no Mistral tokenizer file loads."""
    try:
        import mistral_common  # noqa: F401 - transformers imports it lazily; a clear error first
    except ImportError as exc:
        raise ConfigError("tokenizer_mode", "mistral", f"mistral_common installed: {INSTALL_HINT}") from exc
    try:
        tokenizer = _tokenizer_class().from_pretrained(name_or_path, revision=revision or "main")
    except Exception as exc:  # noqa: BLE001 - mistral_common raises ValueError, AssertionError, OSError...
        raise ConfigError("tokenizer", name_or_path, f"a folder or hub id with a Mistral tokenizer file (tekken.json "
                                                     f"or tokenizer.model.v<N>) for tokenizer_mode='mistral' "
                                                     f"({type(exc).__name__}: {exc})") from exc
    instruct = tokenizer.tokenizer.instruct_tokenizer
    if getattr(instruct, "image_encoder", None) is not None:
        instruct.image_encoder = _image_placeholder_class()(instruct.image_encoder.image_config,
                                                            instruct.image_encoder.special_ids)
    return tokenizer


@functools.cache
def _image_placeholder_class() -> type:
    """mistral_common's image encoder writing one ``[IMG]`` per image, which the host expands to the image's rows
    (``[IMG] * cols + [IMG_BREAK]``, the last ``[IMG_END]``: asyncllm/models/mistral3.py) from the pixels
    transformers' Pixtral processor prepares; the image itself is neither read nor resized here."""
    import numpy as np
    from mistral_common.tokens.tokenizers.image import ImageEncoder, ImageEncoding

    class ImagePlaceholder(ImageEncoder):
        def __call__(self, content: Any) -> Any:
            return ImageEncoding(tokens=[self.special_ids.img], image=np.zeros((3, 1, 1), np.float32))

    return ImagePlaceholder


@functools.cache
def _tokenizer_class() -> type:
    """transformers' `MistralCommonBackend`, except that an id past the vocabulary decodes to nothing, as a Hugging
    Face tokenizer's does (mistral_common raises; a model may sample such an id when its vocabulary is padded), and
    its control tokens are its added tokens (transformers raises on ``added_tokens_decoder``)."""
    from transformers.tokenization_mistral_common import MistralCommonBackend

    class MistralTokenizer(MistralCommonBackend):
        def _decode(self, token_ids: Any, *args: Any, **kwargs: Any) -> str:
            if isinstance(token_ids, int):
                token_ids = [token_ids]
            return super()._decode([t for t in token_ids if 0 <= t < self.vocab_size], *args, **kwargs)

        @property
        def added_tokens_decoder(self) -> dict[int, Any]:  # transformers' raises NotImplementedError
            """The control tokens as special added tokens (the detokenizer's `added_tokens` reads them)."""
            from tokenizers import AddedToken

            ids = sorted(self.all_special_ids)
            return {i: AddedToken(t, special=True) for i, t in zip(ids, self.convert_ids_to_tokens(ids))}

        def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
            if isinstance(ids, int):
                return super().convert_ids_to_tokens(ids, skip_special_tokens) if 0 <= ids < self.vocab_size else ""
            return [self.convert_ids_to_tokens(int(i), skip_special_tokens) for i in ids]

    return MistralTokenizer


def is_mistral(tokenizer: object) -> bool:
    """Whether ``tokenizer`` is mistral_common's (checked without importing it)."""
    return any(cls.__name__ == "MistralCommonBackend" for cls in type(tokenizer).__mro__)


def _without_effort_kwargs(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` less what vLLM's Mistral tokenizer drops of a ``reasoning_effort``: the ``enable_thinking`` the
    server derives from it (`openai_protocol.template_kwargs`; one that says otherwise is the request's own, refused),
    and the effort itself below tokenizer v15 (mistral_common refuses it there; vLLM passes it from v15 on)."""
    if "reasoning_effort" not in kwargs:
        return kwargs
    effort = kwargs["reasoning_effort"]
    drop = {"enable_thinking"} if kwargs.get("enable_thinking", effort != "none") == (effort != "none") else set()
    version = str(tokenizer.tokenizer.instruct_tokenizer.tokenizer.version)  # "v13"
    if int(version.rsplit("v", 1)[-1]) < 15:
        drop.add("reasoning_effort")
    return {k: v for k, v in kwargs.items() if k not in drop}


def render_mistral_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        kwargs: dict[str, Any]) -> MistralChat:
    """``messages`` encoded by mistral_common (``kwargs``: `asyncllm.tokenizer.template_arguments`' for the
    request, less `_without_effort_kwargs`); what it refuses (a conversation it does not take, an unknown role, a
    template variable it does not read) an `InvalidRequestError`."""
    if "chat_template" in kwargs:
        raise InvalidRequestError("chat_template", "tokenizer_mode='mistral' has no Jinja template to replace: "
                                                   "mistral_common encodes the chat")
    kwargs = _without_effort_kwargs(tokenizer, kwargs)
    unknown = sorted(set(kwargs) - _CHAT_KWARGS - {"tools"})
    if unknown:
        raise InvalidRequestError("chat_template_kwargs", f"{unknown} are not read by mistral_common's chat "
                                                          f"encoding (it takes {sorted(_CHAT_KWARGS)})")
    if kwargs.get("continue_final_message"):
        kwargs = {**kwargs, "add_generation_prompt": False}
    stand_ins = [_with_stand_ins(tokenizer, i, m) for i, m in enumerate(messages)]
    try:
        token_ids = tokenizer.apply_chat_template(stand_ins, tokenize=True, return_dict=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - mistral_common's validation errors: a 400, as vLLM's
        raise InvalidRequestError("messages", f"mistral_common refused them ({type(exc).__name__}: {exc})") from exc
    token_ids = [int(t) for t in token_ids]
    if stand_ins != messages:
        token_ids = _one_audio_token_each(token_ids, tokenizer.convert_tokens_to_ids(AUDIO_TOKEN))
    return MistralChat(tokenizer.decode(token_ids), token_ids)


def mistral_transcribes(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether mistral_common encodes a whole-utterance transcription request with ``tokenizer`` (Voxtral's
    tekken.json: an audio section and a ``[TRANSCRIBE]`` token; not the streaming format of realtime models)."""
    instruct = tokenizer.tokenizer.instruct_tokenizer
    encoder = getattr(instruct, "audio_encoder", None)
    return (encoder is not None and getattr(instruct, "TRANSCRIBE", None) is not None
            and not getattr(encoder.audio_config, "is_streaming", False))


def render_mistral_transcription(tokenizer: PreTrainedTokenizerBase, language: str | None) -> list[int]:
    """The prompt ids of mistral_common's transcription request in ``language`` (an ISO-639-1 code; None: its form
    without one, the model tells the language itself): ``<s>[INST][BEGIN_AUDIO][AUDIO][/INST]lang:xx[TRANSCRIBE]``,
    the ``[AUDIO]`` run a stand-in silence got cut to one, as a chat's (`_one_audio_token_each`); a language
    mistral_common refuses an `InvalidRequestError`."""
    from mistral_common.protocol.transcription.request import TranscriptionRequest

    audio = io.BytesIO(base64.b64decode(_silence_wav()))
    try:
        request = TranscriptionRequest.from_openai({"file": audio, "language": language})
    except ValueError as exc:  # pydantic's ValidationError: not an ISO-639-1 code
        raise InvalidRequestError("language", f"an ISO-639-1 code (e.g. 'en') or none, got {language!r}") from exc
    token_ids = [int(t) for t in tokenizer.tokenizer.encode_transcription(request).tokens]
    return _one_audio_token_each(token_ids, tokenizer.convert_tokens_to_ids(AUDIO_TOKEN))


def _with_stand_ins(tokenizer: PreTrainedTokenizerBase, i: int, message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with each media part (``{"type": "audio"}`` / ``"image"``, asyncllm/mm/inputs.py's) a stand-in
    mistral_common encodes: a short silence, which Voxtral's encoder writes as ``[BEGIN_AUDIO]`` and a run of
    ``[AUDIO]`` (cut to one: `_one_audio_token_each`), and a 1-pixel image, which the placeholder encoder writes as
    one ``[IMG]`` (`_image_placeholder_class`); the host fills each in. A kind the tokenizer has no section for, and
    video, is refused."""
    content = message.get("content")
    if not isinstance(content, list) or all(part.get("type") == "text" for part in content):
        return message
    instruct = tokenizer.tokenizer.instruct_tokenizer
    parts = []
    for part in content:
        kind = part.get("type")
        encoder = {"audio": "audio_encoder", "image": "image_encoder"}.get(kind)
        if kind == "video":
            raise InvalidRequestError("messages", f"item {i}: video parts with tokenizer_mode='mistral' are not "
                                                  "built (audio and images are)")
        if encoder is not None and getattr(instruct, encoder, None) is None:
            raise InvalidRequestError("messages", f"item {i}: {kind} parts for a model whose Mistral tokenizer file "
                                                  f"has no {kind} section")
        if kind == "audio":
            part = {"type": "input_audio", "input_audio": {"data": _silence_wav(), "format": "wav"}}
        elif kind == "image":
            part = {"type": "image_url", "image_url": {"url": _one_pixel_png()}}
        parts.append(part)
    return {**message, "content": parts}


def one_placeholder_each(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> list[int]:
    """``token_ids`` as mistral_common encodes media (vLLM's ``prompt_token_ids`` for Pixtral and Voxtral) with each
    image's rows (``[IMG]`` and ``[IMG_BREAK]`` up to its ``[IMG_END]``) and each ``[AUDIO]`` run cut to the one
    placeholder the host expands; ``token_ids`` itself when it holds no such run."""
    image, brk, end, audio = (_control_id(tokenizer, t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]", AUDIO_TOKEN))
    out, k = [], 0
    while k < len(token_ids):
        stop = k
        if image is not None and token_ids[k] == image:
            while stop < len(token_ids) and token_ids[stop] in (image, brk):
                stop += 1
        if stop > k and stop < len(token_ids) and token_ids[stop] == end:  # a whole image's rows, its end
            out.append(image)
            k = stop + 1
            continue
        out.append(token_ids[k])
        k += 1
    out = out if audio is None else _one_audio_token_each(out, audio)
    return token_ids if len(out) == len(token_ids) else out  # cutting only shortens


def _control_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    """The id of control token ``token``, None when the vocabulary has none (not its unknown token's id)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token else None


def _one_audio_token_each(token_ids: list[int], audio_id: int) -> list[int]:
    """Each run of ``[AUDIO]`` ids cut to one: the host repeats it once per row of that audio's features."""
    return [t for k, t in enumerate(token_ids) if t != audio_id or k == 0 or token_ids[k - 1] != audio_id]


@functools.cache
def _one_pixel_png() -> str:
    """A 1 x 1 black PNG as a data URL (the placeholder encoder never reads it; mistral_common checks its form)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@functools.cache
def _silence_wav() -> str:
    """A tenth of a second of 16 kHz silence as a base64 WAV file."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(bytes(3_200))
    return base64.b64encode(buffer.getvalue()).decode()


def xgrammar_vocab(tokenizer: PreTrainedTokenizerBase) -> tuple[list[bytes], bool]:
    """The vocabulary xgrammar reads, one entry per id: tekken's byte strings (raw) or sentencepiece's pieces
    (byte fallback), control tokens as b"" so that no grammar emits one; and whether it is tekken's."""
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    inner = tokenizer.tokenizer.instruct_tokenizer.tokenizer
    control = set(tokenizer.all_special_ids)
    if isinstance(inner, Tekkenizer):
        return [b"" if i in control else inner.id_to_byte_piece(i, SpecialTokenPolicy.KEEP)
                for i in range(inner.n_words)], True
    pieces = tokenizer.convert_ids_to_tokens(list(range(inner.n_words)))
    return [b"" if i in control else piece.encode() for i, piece in enumerate(pieces)], False
