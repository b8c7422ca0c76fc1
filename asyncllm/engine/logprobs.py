"""Host side of logprobs: packed worker arrays -> `Logprob` dicts, on the processor thread.

The workers send `protocol.LogprobsArrays` (token ids, float32 logprobs and
ranks as raw bytes); here each row becomes ``{token_id: Logprob}`` with the
row's own token first, then the top-N in order. ``decoded_token`` is vLLM V1's
(its LogprobsProcessor): the token decoded alone with special tokens kept,
with two repairs:

* a Metaspace (SentencePiece) piece gets back the leading spaces its ``▁``
  marks stand for, which ``decode`` strips from a lone token (``▁t`` is " t",
  not "t": vLLM's ``convert_ids_list_to_tokens``);
* a text ending in U+FFFD (a byte token of an unfinished UTF-8 character) is
  decoded again after 1 to 4 tokens of the sequence before it (the own tokens
  of the preceding rows: sampled tokens, or prompt tokens from the second on),
  and is what that token adds to the decoded text: "" while the character is
  still incomplete, the whole character on its last byte ("€" on ``<0xAC>``
  after ``<0xE2><0x82>``: "", "", "€"). Every token of a row (the top-N too)
  is repaired against the same preceding tokens, as vLLM's ``_verify_tokens``.

Texts are cached per id except those ending in U+FFFD, whose repair depends on
the tokens before them: only those take the extra decodes.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import numpy as np

from asyncllm.engine.added_tokens import in_vocabulary
from asyncllm.engine.detokenizer import REPLACEMENT_CHAR
from asyncllm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from asyncllm.protocol import LogprobsArrays

__all__ = ["LogprobsDecoder", "PromptLogprobsBuffer", "text_context"]

TEXT_CONTEXT = 4
"""Preceding tokens a byte token's text is repaired with: a UTF-8 character has at most 4 bytes."""


def text_context(token_ids: Sequence[int]) -> list[int]:
    """The tokens of `token_ids` (those before a row, oldest first) a byte token's text may need."""
    return list(token_ids[-TEXT_CONTEXT:])


def _no_text(token_id: int, context: list[int]) -> None:
    return None


def leading_space_marker(tokenizer: Any) -> str | None:
    """The replacement character of a Metaspace pre-tokenizer (alone or in a Sequence), whose leading marks
    ``decode`` strips from a lone token; None for any other tokenizer (byte-level, WordPiece, a slow one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (AttributeError, TypeError, ValueError):
        return None
    parts = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    return next((part.get("replacement", "\u2581") for part in parts if part.get("type") == "Metaspace"), None)


class LogprobsDecoder:
    """Builds `Logprob` dicts from packed arrays; one per processor thread (its cache is not locked)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._marker = leading_space_marker(tokenizer)
        self._token_text: dict[int, str] = {}
        self._partial: set[int] = set()
        """Ids whose text alone ends in U+FFFD (not cached: their `decoded_token` depends on the tokens before)."""

    def decoded_token(self, token_id: int, context: list[int]) -> str:
        """The token's ``decoded_token`` after the tokens `context` (oldest first; see the module docstring)."""
        text = self._token_text.get(token_id)  # the common case, first
        if text is None:
            text = self._text_alone(token_id)
        return self._completed(token_id, context) if text is None else text

    def _text_alone(self, token_id: int) -> str | None:
        """The token's text alone (cached), None when it ends in U+FFFD."""
        text = self._token_text.get(token_id)
        if text is None and token_id not in self._partial:
            text = self._alone(token_id)
            if text.endswith(REPLACEMENT_CHAR):
                self._partial.add(token_id)
                return None
            self._token_text[token_id] = text
        return text

    def _alone(self, token_id: int) -> str:
        """The token decoded alone with special tokens kept, the leading spaces of its Metaspace marks restored."""
        text = self._decode([token_id])
        if self._marker is None:
            return text
        piece = (self._tokenizer.convert_ids_to_tokens(token_id) if in_vocabulary(self._tokenizer, [token_id])
                 else None) or ""
        missing = (len(piece) - len(piece.lstrip(self._marker))) - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def _completed(self, token_id: int, context: list[int]) -> str:
        """What a byte token adds to the text after the fewest of `context`'s last tokens that end its character
        (vLLM's ``_correct_decoded_token``): the decoded run less the text of its tokens before the run's own byte
        tokens (those had ""); "" when no run of up to `TEXT_CONTEXT` tokens ends the character. That is "" at once
        when the token before is whole (its text does not end in U+FFFD): UTF-8 resynchronizes there, so the token's
        bytes end incomplete after it as alone (a top-N byte token after a whole one costs no decode)."""
        if not context or self._text_alone(context[-1]) is not None:
            return ""
        for size in range(1, min(len(context), TEXT_CONTEXT) + 1):
            before = context[-size:]
            text = self._decode([*before, token_id])
            if text.endswith(REPLACEMENT_CHAR):
                continue
            clean = len(before)
            while clean and self._text_alone(before[clean - 1]) is None:
                clean -= 1
            prefix = self._decode(before[:clean]) if clean else ""
            return text[len(os.path.commonprefix([prefix, text])):]
        return ""

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(in_vocabulary(self._tokenizer, token_ids), skip_special_tokens=False)

    def decode(self, arrays: LogprobsArrays, with_text: bool = True, preceding: Sequence[int] = ()) -> SampleLogprobs:
        """One dict per row: the row's own token with its rank, then the top-N with ranks 1..N (``decoded_token``
        None without ``with_text``: a request with detokenize=False). An own token that is also in the top-N keeps
        its place first but takes its top-N rank, as vLLM's dict comprehension gives it (they differ on ties).
        `preceding`: the own tokens of the rows before the first (`text_context`), which byte tokens' texts need."""
        width = arrays.width
        ids = np.frombuffer(arrays.token_ids, "<i4").reshape(-1, width).tolist()
        values = np.frombuffer(arrays.logprobs, "<f4").reshape(-1, width).tolist()
        ranks = np.frombuffer(arrays.ranks, "<i4").tolist()
        text: Callable[[int, list[int]], str | None] = self.decoded_token if with_text else _no_text
        context = text_context(preceding)
        out: SampleLogprobs = []
        for row_ids, row_values, rank in zip(ids, values, ranks):
            entry = {row_ids[0]: Logprob(row_values[0], rank, text(row_ids[0], context))}
            for k in range(1, width):
                entry[row_ids[k]] = Logprob(row_values[k], k, text(row_ids[k], context))
            out.append(entry)
            context.append(row_ids[0])
            if len(context) > TEXT_CONTEXT:
                del context[0]
        return out


class PromptLogprobsBuffer:
    """Collects one request's prompt logprobs as its prefill chunks are computed.

    Rows are written at their prompt positions, so a chunk computed twice
    (a preemption before the first token) overwrites itself with the same values.
    """

    def __init__(self, num_prompt_tokens: int) -> None:
        self.entries: PromptLogprobs = [None] * num_prompt_tokens

    def add(self, arrays: LogprobsArrays, decoder: LogprobsDecoder, with_text: bool = True) -> None:
        start = arrays.start  # the tokens of the rows before (vLLM's window: prompt token 0 has no row)
        preceding = [next(iter(entry)) for entry in self.entries[max(0, start - TEXT_CONTEXT):start] if entry]
        rows = decoder.decode(arrays, with_text, preceding)
        self.entries[arrays.start : arrays.start + len(rows)] = rows
