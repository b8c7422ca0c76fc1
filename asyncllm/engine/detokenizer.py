"""Incremental detokenization and stop strings, one `IncrementalDetokenizer` per request.

Runs on the host's processor thread. Each update turns newly sampled token
ids into the text that is safe to show now, in three stages, token by token
(so the result does not depend on how the core batches tokens into updates):

1. decode: `tokenizers`' ``DecodeStream`` (fast tokenizers) or the same
   sliding-window algorithm over ``decode`` (byte-fallback and slow
   tokenizers). Text is held back while it ends in an incomplete UTF-8
   sequence (U+FFFD), and released as soon as the character completes (a
   byte-fallback ``<0x0A>`` is a newline at once, so ``stop=["\n"]`` ends
   the request on that token) or the request finishes: then as U+FFFD that
   stop strings never match. The hold of invalid UTF-8 is bounded: once more
   than 8 ids (`_MAX_HELD_IDS`) are held with their text ending in U+FFFD and
   a U+FFFD before its end (invalid bytes: a lone continuation byte that
   ``allowed_token_ids`` or ``logit_bias`` can force, repeated), the text of
   all but the last 1-3 is released as decode() shows it, U+FFFD included (stop
   strings match it as any text), and the window goes on from them. So such a
   run decodes a bounded window a token; valid text that keeps ending inside a
   character (byte-level tokens that each end one and begin the next) is held
   as long as it lasts, as vLLM's DecodeStream. Special tokens that
   ``skip_special_tokens`` drops never enter the window.
   With ``spaces_between_special_tokens=False`` (and special tokens kept), an
   added token right after another is emitted as its bare content (vLLM's
   rule, `AddedTokensJoined`).
2. clean-up: when the tokenizer's ``decode`` applies
   ``clean_up_tokenization_spaces`` (" ." -> "."), the same rewrite applied in
   a streaming-safe way (`SpacesCleanup`), its text still split by token.
3. stop strings: text that could still be the start of a stop string is held
   back; a match truncates the text and ends the request (`StopStringMatcher`).
   It counts by the token whose text completed it (past min_tokens), and the
   ids after that token are dropped; `num_final` says which ids are past that
   risk (clean-up may hold a token's text until later tokens come).

Exactness: without stop strings (and with spaces_between_special_tokens), the deltas add up to
``tokenizer.decode(output_token_ids, skip_special_tokens=...)``, the text HF
users get, less the EOS or stop token that ended the request (vLLM's rule,
`IncrementalDetokenizer.update`). One exception, as vLLM's DecodeStream: a
byte-fallback run that turns invalid UTF-8 after characters of it were shown.
sentencepiece's ByteFallback decoder then writes every byte of the run as
U+FFFD, the shown characters included; the stream keeps what it showed and
writes U+FFFD for the rest of the run (their count follows the decoding
window, so it may differ from decode()'s, as it may for a run past the hold's bound;
the text before and after the run is decode()'s). vLLM's DecodeStream drops such bytes instead. Another: a slow
tokenizer whose decode writes before text it wrote for earlier ids (GPT-SW3's
puts a space before the text that precedes a special token): that text is
shown already, so the stream decodes added tokens apart instead (vLLM's slow
path), and lacks those spaces.

The prompt's end is the decoding context, as vLLM primes its DecodeStream: the stream starts after the last 4 (up
to 23) prompt ids whose text decodes whole (`_prompt_suffix`), so the first output token's text is what it adds to
the prompt's. With byte-level tokenizers that is ``decode(output_token_ids)``; with SentencePiece ones whose decoder
drops a text's leading space (Llama 2, Mistral 7B) the first token's space is kept (" Paris", not "Paris"), so the
prompt and the output text add up to the decoding of both, as vLLM's. A prompt given as embeddings (its ids are
placeholders) primes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from asyncllm.engine.added_tokens import (AddedTokensApart, AddedTokensJoined, added_tokens, in_vocabulary,
                                          special_ids)
from asyncllm.engine.spaces_cleanup import SpacesCleanup, cleanup_applies
from asyncllm.engine.stop_strings import StopStringMatcher
from asyncllm.sampling import SamplingParams

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer", "TokenIdsOnly", "new_detokenizer"]

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


class DetokenizerUpdate(NamedTuple):
    """What one `IncrementalDetokenizer.update` produced (a named tuple: one is made per token of every stream).

    ``text`` is safe to emit now. When ``stop_string`` is set, a stop string
    matched: ``text`` ends just before it (or just after it with
    ``include_stop_str_in_output``) and the caller finishes the request with
    finish_reason "stop" and stop_reason ``stop_string``.
    """

    text: str
    stop_string: str | None = None


_NO_TEXT = DetokenizerUpdate("")

def new_detokenizer(tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                    prime: bool = True) -> "IncrementalDetokenizer | TokenIdsOnly":
    """The request's detokenizer: none that decodes with ``detokenize=False`` or without a tokenizer
    (``skip_tokenizer_init``: token ids only, as vLLM's); ``prime``: its text continues the prompt's (false for a
    prompt of embeddings, whose ids are placeholders)."""
    if params.detokenize and tokenizer is not None:
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, params, prime)
    return TokenIdsOnly(prompt_token_ids)


class TokenIdsOnly:
    """`IncrementalDetokenizer`'s interface for ``detokenize=False``: ids pass through, no text, no stop strings."""

    decodes = False
    stop_string = None
    output_text = ""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []

    def update(self, new_token_ids: list[int], finished: bool, stop_terminated: bool = False) -> DetokenizerUpdate:
        self.token_ids += new_token_ids
        return _NO_TEXT

    @property
    def num_final(self) -> int:
        return len(self.token_ids)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas and finds its stop strings."""

    decodes = True

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 prime: bool = True) -> None:
        self.prompt_token_ids = prompt_token_ids
        """Kept for the caller; its last ids are the decoding context (`prime`, the module docstring)."""
        self.token_ids: list[int] = []
        """Output ids consumed so far (up to the token that completed a stop string; see `num_final`)."""
        self.stop_string: str | None = None
        """The stop string that ended the request, once one matched."""
        self._stream = _make_stream(tokenizer, params)
        if prime and prompt_token_ids:
            self._stream.prime(prompt_token_ids)
        self._cleanup = SpacesCleanup(tokenizer.clean_up_tokenization) if cleanup_applies(tokenizer) else None
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._min_tokens = params.min_tokens
        self._include_stop_token = params.include_stop_str_in_output
        self._chunks: list[str] = []

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def num_final(self) -> int:
        """How many of `token_ids` no stop string can drop any more: all, but with clean-up holding text and stop
        strings, those after the first token whose text it holds (a stop string may end in that text, and counts by
        that token)."""
        if self._cleanup is None or self._stops is None or self.stop_string is not None:
            return len(self.token_ids)
        held = self._cleanup.first_held_owner
        return len(self.token_ids) if held is None else held

    def update(self, new_token_ids: list[int], finished: bool, stop_terminated: bool = False) -> DetokenizerUpdate:
        """Consume newly sampled ids; return the text that is now safe to emit.

        Ids are consumed one by one, so the result does not depend on how they
        are batched; when a stop string matches, the ids after the one that
        completed it are dropped (see `token_ids`). With ``finished=True`` all
        held-back text is flushed. After a stop string matched, later calls
        (tokens the core sampled before it saw the abort) return empty updates
        and consume nothing; `stop_string` keeps the match.

        ``stop_terminated``: the last id is the EOS or ``stop_token_ids`` token that ended the request. As
        vLLM, its text is left out (it stays in `token_ids`) unless ``include_stop_str_in_output``: it shows
        only with ``skip_special_tokens=False`` or a stop token that is not special (a newline's id).
        """
        if self.stop_string is not None:
            return _NO_TEXT
        if self._stops is None and self._cleanup is None and not finished and not stop_terminated:  # the common case
            return self._emit([self._step(token_id) for token_id in new_token_ids])
        pieces: list[str] = []
        silent = new_token_ids[-1:] if stop_terminated and not self._include_stop_token else []
        for token_id in new_token_ids[: len(new_token_ids) - len(silent)]:
            self.token_ids.append(token_id)
            if self._push(len(self.token_ids), self._stream.step(token_id), pieces):
                return self._emit(pieces)
        last = len(self.token_ids)
        self.token_ids += silent
        if finished:  # the U+FFFD run the flush ends in, a character the request ended inside, matches no stop
            text = self._stream.flush()  # string (vLLM's stream never shows it): it goes after the held-back text
            kept = text.rstrip(REPLACEMENT_CHAR)
            if not self._push(last, kept, pieces, flush=True):
                pieces += [self._stops.flush() if self._stops is not None else "", text[len(kept):]]
        return self._emit(pieces)

    def _step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        return self._stream.step(token_id)

    def _push(self, owner: int, text: str, pieces: list[str], flush: bool = False) -> bool:
        """Run the text of token ``owner`` (1-based) through clean-up (all it holds too with ``flush``) and stop
        matching; True if a stop string matched."""
        if self._cleanup is None:
            return self._push_stop_checked(owner, text, pieces)
        chunks = self._cleanup.push(owner, text)
        if flush:
            chunks += self._cleanup.flush()
        return any(self._push_stop_checked(chunk_owner, chunk, pieces) for chunk_owner, chunk in chunks)

    def _push_stop_checked(self, owner: int, text: str, pieces: list[str]) -> bool:
        # As vLLM: a stop string counts once it ends in the text of a token after the first min_tokens (it may begin
        # before: that text is held back as any text that may begin one); the ids after that token are dropped
        if self._stops is None:
            pieces.append(text)
            return False
        emitted, self.stop_string = self._stops.push(text, match=owner > self._min_tokens)
        pieces.append(emitted)
        if self.stop_string is None:
            return False
        del self.token_ids[owner:]
        return True

    def _emit(self, pieces: list[str]) -> DetokenizerUpdate:
        text = "".join(pieces)
        if not text and self.stop_string is None:
            return _NO_TEXT
        if text:
            self._chunks.append(text)
        return DetokenizerUpdate(text, self.stop_string)


class _WindowStream:
    """Incremental decoding over a sliding window of ids, for any ``decode`` function.

    ``context`` holds the ids of the last emitted piece (after a piece of
    whitespace only, those of the last piece with other text before it too:
    SentencePiece's decode drops a text's leading whitespace), ``pending`` the ids
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
                 decode_apart: Callable[[list[int]], str] | None = None) -> None:
        self._decode = decode
        self._skipped = skipped
        """Ids ``decode`` drops (special tokens with ``skip_special_tokens``): they never enter the window."""
        self._decode_apart = decode_apart
        self._context: list[int] = []
        self._pending: list[int] = []
        self._anchor: list[int] = []
        """The ids of the last emitted piece with text other than whitespace."""
        self._prefix: str | None = None
        """``decode(context)``, computed once per context."""

    def prime(self, prompt_token_ids: list[int]) -> None:
        """Decode what follows as the continuation of the prompt's last ids (`_prompt_suffix`), as vLLM's stream."""
        self._context = self._anchor = [t for t in _prompt_suffix(self._decode, prompt_token_ids)
                                        if t not in self._skipped]
        self._prefix = None

    def step(self, token_id: int) -> str:
        if token_id in self._skipped:
            return ""
        self._pending.append(token_id)
        text = self._pending_text()
        if not text or text.endswith(REPLACEMENT_CHAR):
            return self._cut(text) if self._past_bound(text) else ""
        if text.isspace():
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

    def __init__(self, backend: Any, skip_special_tokens: bool, skipped: frozenset[int]) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens), skipped)
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
        if self._decode_stream is None or token_id in self._skipped:
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


def _make_stream(tokenizer: Any, params: SamplingParams) -> _WindowStream | AddedTokensJoined:
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
    if backend is not None and not getattr(backend.model, "byte_fallback", False):
        return _FastStream(backend, skip_special_tokens, skipped)
    if backend is not None:
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _WindowStream(decode, skipped)

    def decode_slow(ids: list[int]) -> str:
        return tokenizer.decode(in_vocabulary(tokenizer, ids), skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)
    return _WindowStream(decode_slow, skipped, AddedTokensApart(tokenizer, decode_slow))
