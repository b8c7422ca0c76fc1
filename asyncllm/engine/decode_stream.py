"""The detokenizer's decode streams (asyncllm/engine/detokenizer.py's first stage): tokenizers' ``DecodeStream`` for
fast tokenizers, the same sliding-window algorithm over ``decode`` for the others, each able to continue a prompt's
text (`_WindowStream.prime`) and to flush what it holds."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from asyncllm.engine.added_tokens import (AddedTokensApart, AddedTokensJoined, added_tokens, in_vocabulary, special_ids,
                                          vocabulary_size)
from asyncllm.sampling import SamplingParams

__all__ = ["REPLACEMENT_CHAR", "make_stream"]

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
"""What ``decode`` writes for the bytes of an incomplete UTF-8 character (logprobs.py's too)."""
_MAX_HELD_IDS = 8
"""The most ids a decode stream holds while their text is empty or `_invalid` (a character has at most 4 bytes):
past it the stream cuts the run (`_WindowStream._cut`), so each token decodes a bounded window. Text ending in one
U+FFFD is held without bound (as vLLM's DecodeStream): byte-level tokens can each end a character and begin one."""
_KEPT_AT_CUT = 3
"""The most held ids a cut keeps, the last: a character they may still complete has at most 3 bytes so far."""


def _invalid(text: str) -> bool:
    """Whether held text ending in U+FFFD has invalid UTF-8: a U+FFFD before its end. Byte-level decode writes one
    for an incomplete last character; byte fallback one a byte, but it holds at most 3 ids of a valid character."""
    return REPLACEMENT_CHAR in text[:-1]


class _WindowStream:
    """Incremental decoding over a sliding window of ids, for any ``decode`` function.

    ``context`` holds the ids of the last emitted piece (after a piece of
    whitespace only that decodes to less alone, those of the last piece that
    does not before it too: SentencePiece's decode drops a text's leading
    ``▁`` spaces, not a byte piece's tab), ``pending`` the ids
    decoded since; the new text is ``decode(context + pending)`` minus
    ``decode(context)``, released once it does not end in U+FFFD. This is the
    algorithm of ``tokenizers.decoders.DecodeStream``, kept here so that the
    held-back ids can be flushed at the end, and for the tokenizers
    DecodeStream refuses: byte-fallback ones, whose decoder rewrites a whole
    byte run as U+FFFD once a byte of it is invalid (the text is then sliced
    by length, as vLLM's original algorithm did; see the module docstring).

    ``decode_apart``: for a ``decode`` that rewrites the text of ids before new ones (GPT-SW3's slow tokenizer
    puts a space before the text that precedes a special token), a decode that cannot (`AddedTokensApart`),
    used while ``decode(context + pending)`` does not start with ``decode(context)``.
    """

    def __init__(self, decode: Callable[[list[int]], str], skipped: frozenset[int],
                 decode_apart: Callable[[list[int]], str] | None = None, vocab_size: int = -1) -> None:
        self._decode = decode
        self._skipped = skipped
        """Ids ``decode`` drops (special tokens with ``skip_special_tokens``): they never enter the window."""
        self._vocab_size = vocab_size
        """Ids from it on (past the tokenizer: a padded model's) decode to nothing and never enter the window either,
        so they neither count towards `_MAX_HELD_IDS` nor split a character they come between; -1: unknown."""
        self._decode_apart = decode_apart
        self._context: list[int] = []
        self._pending: list[int] = []
        self._anchor: list[int] = []
        """The ids of the last emitted piece whose text ``decode`` gives alone (whitespace a text starts with drops)."""
        self._prefix: str | None = None
        """``decode(context)``, computed once per context."""

    def prime(self, prompt_token_ids: list[int]) -> None:
        """Decode what follows as the continuation of the prompt's last ids (`_prompt_suffix`), as vLLM's stream."""
        self._context = self._anchor = [t for t in _prompt_suffix(self._decode, prompt_token_ids)
                                        if not self._dropped(t)]
        self._prefix = None

    def _dropped(self, token_id: int) -> bool:
        """Whether the id adds no text and stays out of the window (skipped, or past the vocabulary)."""
        if token_id in self._skipped:
            return True
        return self._vocab_size >= 0 and not 0 <= token_id < self._vocab_size

    def step(self, token_id: int) -> str:
        if self._dropped(token_id):
            return ""
        self._pending.append(token_id)
        text = self._pending_text()
        if not text or text.endswith(REPLACEMENT_CHAR):
            return self._cut(text) if self._past_bound(text) else ""
        if text.isspace() and self._decode(self._pending) != text:
            self._context, self._pending, self._prefix = self._anchor + self._pending, [], None
            return text
        self._anchor = self._pending
        return self._advance(text)

    def flush(self) -> str:
        """Release the text of the held-back ids, complete or not (U+FFFD stays, as decode() shows it)."""
        if not self._pending:
            return ""
        return self._advance(self._pending_text())

    def _past_bound(self, text: str) -> bool:
        """Whether the held ids (their text ``text``, empty or ending in U+FFFD) are to be cut."""
        return len(self._pending) > _MAX_HELD_IDS and (not text or _invalid(text))

    def _cut(self, held_text: str) -> str:
        """Release the text of the held ids but the last 1 or 2 where it is final (``held_text`` less its last char
        starts with it), else but the last `_KEPT_AT_CUT`, and make them the context (ids adding no text dropped)."""
        held = self._pending
        for split in range(len(held) - 1, len(held) - _KEPT_AT_CUT - 1, -1):
            self._pending = held[:split]
            text = self._pending_text()
            if (text and held_text[:-1].startswith(text)) or split == len(held) - _KEPT_AT_CUT:
                break
        if text:
            self._context, self._anchor, self._prefix = self._pending, self._pending, None
        self._pending = held[split:]
        return text

    def _pending_text(self) -> str:
        """``decode(context + pending)`` past ``decode(context)``; by ``decode_apart`` where that is prefix-stable
        and ``decode`` is not (else sliced by length, as vLLM's algorithm)."""
        prefix = self._prefix_text()
        text = self._decode(self._context + self._pending)
        if self._decode_apart is not None and not text.startswith(prefix):
            prefix_apart = self._decode_apart(self._context)
            text_apart = self._decode_apart(self._context + self._pending)
            if text_apart.startswith(prefix_apart):
                prefix, text = prefix_apart, text_apart
        return text[len(prefix):]

    def _prefix_text(self) -> str:
        if self._prefix is None:
            self._prefix = self._decode(self._context)
        return self._prefix

    def _advance(self, text: str) -> str:
        self._context, self._pending, self._prefix = self._pending, [], None
        return text


class _FastStream(_WindowStream):
    """``DecodeStream`` stepping on the Rust tokenizer, with the window mirrored for `flush`.

    If the stream ever refuses a step (tokenizers raises when a decoder
    rewrites text it already produced), decoding goes on with the Python
    window, which slices by length as vLLM's original algorithm did; so it
    does from a cut (`_MAX_HELD_IDS`: DecodeStream cannot let go of held ids).
    """

    def __init__(self, backend: Any, skip_special_tokens: bool, skipped: frozenset[int], vocab_size: int) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens), skipped,
                         vocab_size=vocab_size)
        self._backend = backend
        self._decode_stream: Any = DecodeStream(skip_special_tokens=skip_special_tokens)

    def prime(self, prompt_token_ids: list[int]) -> None:
        super().prime(prompt_token_ids)
        try:
            for token_id in self._context:
                self._decode_stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - as in `step`: the window decodes from here
            self._decode_stream = None

    def step(self, token_id: int) -> str:
        if self._decode_stream is None or self._dropped(token_id):
            return super().step(token_id)
        try:
            text = self._decode_stream.step(self._backend, token_id)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            logger.warning("DecodeStream failed (%s); decoding this request with the sliding window", exc)
            self._decode_stream = None
            return super().step(token_id)
        self._pending.append(token_id)
        if text is not None:
            return self._advance(text)
        if len(self._pending) <= _MAX_HELD_IDS or not self._past_bound(held_text := self._pending_text()):
            return ""
        self._decode_stream = None
        return self._cut(held_text)


def _prompt_suffix(decode: Callable[[list[int]], str], prompt_token_ids: list[int]) -> list[int]:
    """The prompt's ids a stream continues (vLLM's choice): all of a prompt of 4 or fewer, else the shortest of its
    last 4 to 23 whose text decodes whole (no U+FFFD); none when none does (the output decoded alone)."""
    if len(prompt_token_ids) <= 4:
        return list(prompt_token_ids)
    for length in range(4, min(len(prompt_token_ids), 23) + 1):
        suffix = list(prompt_token_ids[-length:])
        if REPLACEMENT_CHAR not in decode(suffix):
            return suffix
    return []


def make_stream(tokenizer: Any, params: SamplingParams) -> _WindowStream | AddedTokensJoined:
    """The decode stream, with added tokens joined when `SamplingParams.spaces_between_special_tokens` is off
    and special tokens are kept (no-op without added tokens, as vLLM)."""
    stream = _decode_stream(tokenizer, params.skip_special_tokens)
    if params.skip_special_tokens or params.spaces_between_special_tokens:
        return stream
    added = added_tokens(tokenizer)
    return AddedTokensJoined(stream, added) if added else stream


def _decode_stream(tokenizer: Any, skip_special_tokens: bool) -> _WindowStream:
    """DecodeStream for fast tokenizers without byte fallback; the Python window otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    skipped = special_ids(tokenizer) if skip_special_tokens else frozenset()
    size = vocabulary_size(tokenizer)
    if backend is not None and not getattr(backend.model, "byte_fallback", False):
        return _FastStream(backend, skip_special_tokens, skipped, size)
    if backend is not None:
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _WindowStream(decode, skipped, vocab_size=size)

    def decode_slow(ids: list[int]) -> str:
        return tokenizer.decode(in_vocabulary(tokenizer, ids), skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)
    return _WindowStream(decode_slow, skipped, AddedTokensApart(tokenizer, decode_slow), size)
