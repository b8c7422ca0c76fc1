"""Incremental detokenization and stop strings, one `IncrementalDetokenizer` per request.

Runs on the host's processor thread. Each update turns newly sampled token
ids into the text that is safe to show now, in three stages, token by token
(so the result does not depend on how the core batches tokens into updates):

1. decode: `tokenizers`' ``DecodeStream`` (fast tokenizers) or the same
   sliding-window algorithm over ``decode`` (byte-fallback and slow
   tokenizers). Text is held back while it ends in an incomplete UTF-8
   sequence (U+FFFD), and released as soon as the character completes (a
   byte-fallback ``<0x0A>`` is a newline at once, so ``stop=["\n"]`` ends
   the request on that token) or the request finishes.
   With ``spaces_between_special_tokens=False`` (and special tokens kept), an
   added token right after another is emitted as its bare content (vLLM's
   rule, `_AddedTokensJoined`).
2. clean-up: when the tokenizer's ``decode`` applies
   ``clean_up_tokenization_spaces`` (" ." -> "."), the same rewrite applied in
   a streaming-safe way.
3. stop strings: text that could still be the start of a stop string is held
   back; a match truncates the text and ends the request (`StopStringMatcher`).

Exactness: without stop strings (and with spaces_between_special_tokens), the deltas add up to
``tokenizer.decode(output_token_ids, skip_special_tokens=...)``, the text HF
users get, less the EOS or stop token that ended the request (vLLM's rule,
`IncrementalDetokenizer.update`). One exception, as vLLM's DecodeStream: a
byte-fallback run that turns invalid UTF-8 after characters of it were shown.
sentencepiece's ByteFallback decoder then writes every byte of the run as
U+FFFD, the shown characters included; the stream keeps what it showed and
writes U+FFFD for the rest of the run (their count follows the decoding
window, so it may differ from decode()'s; the text before and after the run is
decode()'s). vLLM's DecodeStream drops such bytes instead. The prompt is deliberately not used as decoding context: with
sentencepiece-style tokenizers (Llama 2, Mistral) it would add the leading
space of the first output token, which ``decode(output_token_ids)`` drops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncllm.engine.stop_strings import StopStringMatcher
from asyncllm.sampling import SamplingParams

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer", "TokenIdsOnly", "new_detokenizer"]

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"

_CLEANUP_TAIL_CHARS = frozenset(" n'vr")
"""Every proper prefix of a clean-up pattern (" .", " n't", " 've", ...) is made of these, and starts with a space."""


@dataclass(frozen=True)
class DetokenizerUpdate:
    """What one `IncrementalDetokenizer.update` produced.

    ``text`` is safe to emit now. When ``stop_string`` is set, a stop string
    matched: ``text`` ends just before it (or just after it with
    ``include_stop_str_in_output``) and the caller finishes the request with
    finish_reason "stop" and stop_reason ``stop_string``.
    """

    text: str
    stop_string: str | None = None


_NO_TEXT = DetokenizerUpdate("")

def new_detokenizer(tokenizer: Any, prompt_token_ids: list[int],
                    params: SamplingParams) -> "IncrementalDetokenizer | TokenIdsOnly":
    """The request's detokenizer: none that decodes with ``detokenize=False`` or without a tokenizer
    (``skip_tokenizer_init``: token ids only, as vLLM's)."""
    if params.detokenize and tokenizer is not None:
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
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


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas and finds its stop strings."""

    decodes = True

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.prompt_token_ids = prompt_token_ids
        """Kept for the caller; the text deliberately does not depend on it (see the module docstring)."""
        self.token_ids: list[int] = []
        """Output ids consumed so far (up to the token that completed a stop string)."""
        self.stop_string: str | None = None
        """The stop string that ended the request, once one matched."""
        self._stream = _make_stream(tokenizer, params)
        self._cleanup = _SpacesCleanup(tokenizer.clean_up_tokenization) if _cleanup_applies(tokenizer) else None
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
            return DetokenizerUpdate("")
        pieces: list[str] = []
        silent = new_token_ids[-1:] if stop_terminated and not self._include_stop_token else []
        for token_id in new_token_ids[: len(new_token_ids) - len(silent)]:
            self.token_ids.append(token_id)
            if self._push(self._stream.step(token_id), pieces):
                return self._emit(pieces)
        self.token_ids += silent
        if finished:
            flushed = self._stream.flush()
            if self._cleanup is not None:
                flushed = self._cleanup.push(flushed) + self._cleanup.flush()
            if not self._push_stop_checked(flushed, pieces) and self._stops is not None:
                pieces.append(self._stops.flush())
        return self._emit(pieces)

    def _push(self, text: str, pieces: list[str]) -> bool:
        """Run freshly decoded text through clean-up and stop matching; True if a stop string matched."""
        if self._cleanup is not None:
            text = self._cleanup.push(text)
        return self._push_stop_checked(text, pieces)

    def _push_stop_checked(self, text: str, pieces: list[str]) -> bool:
        # As vLLM: a stop string counts once it ends in the text of a token after the first min_tokens (it may begin
        # before: that text is held back as any text that may begin one)
        if self._stops is None:
            pieces.append(text)
            return False
        emitted, self.stop_string = self._stops.push(text, match=len(self.token_ids) > self._min_tokens)
        pieces.append(emitted)
        return self.stop_string is not None

    def _emit(self, pieces: list[str]) -> DetokenizerUpdate:
        text = "".join(pieces)
        if text:
            self._chunks.append(text)
        return DetokenizerUpdate(text, self.stop_string)


class _WindowStream:
    """Incremental decoding over a sliding window of ids, for any ``decode`` function.

    ``context`` holds the ids of the last emitted piece, ``pending`` the ids
    decoded since; the new text is ``decode(context + pending)`` minus
    ``decode(context)``, released once it does not end in U+FFFD. This is the
    algorithm of ``tokenizers.decoders.DecodeStream``, kept here so that the
    held-back ids can be flushed at the end, and for the tokenizers
    DecodeStream refuses: byte-fallback ones, whose decoder rewrites a whole
    byte run as U+FFFD once a byte of it is invalid (the text is then sliced
    by length, as vLLM's original algorithm did; see the module docstring).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._context: list[int] = []
        self._pending: list[int] = []
        self._prefix: str | None = None
        """``decode(context)``, computed once per context."""

    def step(self, token_id: int) -> str:
        self._pending.append(token_id)
        prefix = self._prefix_text()
        text = self._decode(self._context + self._pending)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(text[len(prefix):])

    def flush(self) -> str:
        """Release the text of the held-back ids, complete or not (U+FFFD stays, as decode() shows it)."""
        if not self._pending:
            return ""
        prefix = self._prefix_text()
        return self._advance(self._decode(self._context + self._pending)[len(prefix):])

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
    window, which slices by length as vLLM's original algorithm did.
    """

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        super().__init__(lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens))
        self._backend = backend
        self._decode_stream: Any = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        if self._decode_stream is None:
            return super().step(token_id)
        try:
            text = self._decode_stream.step(self._backend, token_id)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            logger.warning("DecodeStream failed (%s); decoding this request with the sliding window", exc)
            self._decode_stream = None
            return super().step(token_id)
        self._pending.append(token_id)
        return "" if text is None else self._advance(text)


class _AddedTokensJoined:
    """A stream whose added tokens, each right after another, show as their bare content.

    vLLM's ``spaces_between_special_tokens=False`` (its FastIncrementalDetokenizer): a decoder may put a space
    before an added token (WordPiece's does: "[CLS] [SEP]"); such a token's text is replaced by the token's
    content when the token before it was an added token too. The wrapped stream still steps on every id.
    """

    def __init__(self, stream: _WindowStream, added_tokens: dict[int, str]) -> None:
        self._stream = stream
        self._added_tokens = added_tokens
        self._last_added = False

    def step(self, token_id: int) -> str:
        text = self._stream.step(token_id)
        content = self._added_tokens.get(token_id)
        if content is not None and self._last_added:
            text = content
        self._last_added = content is not None
        return text

    def flush(self) -> str:
        return self._stream.flush()


def _make_stream(tokenizer: Any, params: SamplingParams) -> _WindowStream | _AddedTokensJoined:
    """The decode stream, with added tokens joined when `SamplingParams.spaces_between_special_tokens` is off
    and special tokens are kept (no-op without added tokens, as vLLM)."""
    stream = _decode_stream(tokenizer, params.skip_special_tokens)
    if params.skip_special_tokens or params.spaces_between_special_tokens:
        return stream
    added = _added_tokens(tokenizer)
    return _AddedTokensJoined(stream, added) if added else stream


def _added_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's added tokens by id, read once per tokenizer (as vLLM caches them on it: thousands of added
    tokens cost ~2 ms a read)."""
    cached = getattr(tokenizer, "_asyncllm_added_tokens", None)
    if cached is None:
        backend = getattr(tokenizer, "_tokenizer", None)  # vLLM reads the Rust tokenizer's added tokens
        added = backend.get_added_tokens_decoder() if backend is not None else tokenizer.added_tokens_decoder
        cached = {i: token.content for i, token in added.items()}
        try:
            tokenizer._asyncllm_added_tokens = cached
        except (AttributeError, TypeError):  # a tokenizer class that takes no new attribute: read each time
            pass
    return cached


def _decode_stream(tokenizer: Any, skip_special_tokens: bool) -> _WindowStream:
    """DecodeStream for fast tokenizers without byte fallback; the Python window otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(backend.model, "byte_fallback", False):
        return _FastStream(backend, skip_special_tokens)
    if backend is not None:
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    else:
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    return _WindowStream(decode)


def _cleanup_applies(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` rewrites " ." to "." (transformers 5 skips it for BPE models).

    Probed by behaviour rather than by reading transformers' private rules,
    which changed between versions.
    """
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    probe = tokenizer.encode("a . b n't", add_special_tokens=False)
    return tokenizer.decode(probe) != tokenizer.decode(probe, clean_up_tokenization_spaces=False)


class _SpacesCleanup:
    """transformers' ``clean_up_tokenization`` applied to a stream of text.

    Every clean-up pattern starts with a space and only deletes spaces; a
    pattern, or a chain of them (" ' " becomes "'", which may join the space
    before it), can span a cut only from a space inside the text's trailing run
    of characters that proper pattern prefixes are made of (" n'vr"). So the
    text from that run's first space waits for more text, and the rest is
    cleaned and released: "Human" is released whole (a stop string ending in it
    matches on its token); "do n '" waits from its " n".
    """

    def __init__(self, clean: Callable[[str], str]) -> None:
        self._clean = clean
        self._held = ""

    def push(self, text: str) -> str:
        buffer = self._held + text
        run = len(buffer)
        while run > 0 and buffer[run - 1] in _CLEANUP_TAIL_CHARS:
            run -= 1
        space = buffer.find(" ", run)  # a pattern (or a chain of " ' " rewrites) can only start at a space
        cut = len(buffer) if space < 0 else space
        self._held = buffer[cut:]
        return self._clean(buffer[:cut])

    def flush(self) -> str:
        text, self._held = self._clean(self._held), ""
        return text
