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
   than 8 ids (`decode_stream._MAX_HELD_IDS`) are held with their text ending in U+FFFD and
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

from typing import Any, NamedTuple

from asyncllm.engine.decode_stream import REPLACEMENT_CHAR, make_stream
from asyncllm.engine.spaces_cleanup import SpacesCleanup, cleanup_applies
from asyncllm.engine.stop_strings import StopStringMatcher
from asyncllm.sampling import SamplingParams

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer", "TokenIdsOnly", "new_detokenizer", "REPLACEMENT_CHAR"]

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
        self._stream = make_stream(tokenizer, params)
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
