"""A tokenizer's added tokens, for the detokenizer's decode stage (asyncllm/engine/detokenizer.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["AddedTokensApart", "AddedTokensJoined", "added_tokens", "in_vocabulary", "special_ids", "vocabulary_size"]


def added_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's added tokens by id, read once per tokenizer (as vLLM caches them on it: thousands of added
    tokens cost ~2 ms a read)."""
    return _cached(tokenizer, "_asyncllm_added_tokens", lambda: {i: t.content for i, t in _added(tokenizer).items()})


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``decode(..., skip_special_tokens=True)`` drops, read once per tokenizer: the Rust tokenizer's special
    added tokens, a slow tokenizer's ``all_special_ids`` (transformers' rule)."""
    if getattr(tokenizer, "_tokenizer", None) is None:
        return _cached(tokenizer, "_asyncllm_special_ids",
                       lambda: frozenset(getattr(tokenizer, "all_special_ids", ())))
    return _cached(tokenizer, "_asyncllm_special_ids",
                   lambda: frozenset(i for i, t in _added(tokenizer).items() if t.special))


def vocabulary_size(tokenizer: Any) -> int:
    """Where the ids past the tokenizer start: ``len(tokenizer)`` (added tokens included), or past its last added
    token if one lies beyond (a vocabulary with holes), cached; -1 for a tokenizer without a length (duck-typed)."""
    def read() -> int:
        if not hasattr(tokenizer, "__len__"):
            return -1
        try:
            added = _added(tokenizer)
        except (AttributeError, NotImplementedError):  # a duck-typed tokenizer without added tokens
            added = {}
        return max(len(tokenizer), max(added, default=-1) + 1)
    return _cached(tokenizer, "_asyncllm_vocabulary_size", read)


def in_vocabulary(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` less those past the tokenizer (a padded model samples them, or allowed_token_ids / logit_bias force
    them): a fast tokenizer's decode skips them, a slow one's raises (sentencepiece's IndexError); vLLM's slow
    detokenizer gives them no text. A tokenizer without a length (a duck-typed one) is taken as it is."""
    size = _cached(tokenizer, "_asyncllm_len", lambda: len(tokenizer) if hasattr(tokenizer, "__len__") else -1)
    return ids if size < 0 or all(0 <= i < size for i in ids) else [i for i in ids if 0 <= i < size]


def _added(tokenizer: Any) -> dict[int, Any]:
    backend = getattr(tokenizer, "_tokenizer", None)  # vLLM reads the Rust tokenizer's added tokens
    return backend.get_added_tokens_decoder() if backend is not None else tokenizer.added_tokens_decoder


def _cached(tokenizer: Any, name: str, read: Callable[[], Any]) -> Any:
    cached = getattr(tokenizer, name, None)
    if cached is None:
        cached = read()
        try:
            setattr(tokenizer, name, cached)
        except (AttributeError, TypeError):  # a tokenizer class that takes no new attribute: read each time
            pass
    return cached


class AddedTokensApart:
    """A decode of ids with each added token apart, as its content, the runs between by the tokenizer's decode:
    vLLM's slow-tokenizer text (`_convert_tokens_to_string_with_added_encoders`, joined without spaces as
    transformers 5's decode), which an added token cannot rewrite before it. Special ids that
    ``skip_special_tokens`` drops never reach it (the detokenizer's window filters them first)."""

    def __init__(self, tokenizer: Any, decode: Callable[[list[int]], str]) -> None:
        self._tokenizer = tokenizer
        self._decode = decode
        self._texts: dict[int, str] | None = None
        """Each added token's text, read on the first call (a prefix-stable decode never makes one)."""

    def __call__(self, ids: list[int]) -> str:
        texts = self._texts if self._texts is not None else self._added_texts()
        pieces: list[str] = []
        start = 0
        for i, token_id in enumerate(ids):
            if token_id in texts:
                if i > start:
                    pieces.append(self._decode(ids[start:i]))
                pieces.append(texts[token_id])
                start = i + 1
        if start < len(ids):
            pieces.append(self._decode(ids[start:]))
        return "".join(pieces)

    def _added_texts(self) -> dict[int, str]:
        texts = added_tokens(self._tokenizer)
        self._texts = texts
        return texts


class AddedTokensJoined:
    """A stream whose added tokens, each right after another, show as their bare content.

    vLLM's ``spaces_between_special_tokens=False`` (its FastIncrementalDetokenizer): a decoder may put a space
    before an added token (WordPiece's does: "[CLS] [SEP]"); such a token's text is replaced by the token's
    content when the token before it was an added token too. The wrapped stream still steps on every id.
    """

    def __init__(self, stream: Any, added_tokens: dict[int, str]) -> None:
        self._stream = stream
        self._added_tokens = added_tokens
        self._last_added = False

    def prime(self, prompt_token_ids: list[int]) -> None:
        """The wrapped stream continues the prompt, whose last id counts as the token before the first output."""
        self._stream.prime(prompt_token_ids)
        self._last_added = bool(prompt_token_ids) and prompt_token_ids[-1] in self._added_tokens

    def step(self, token_id: int) -> str:
        text = self._stream.step(token_id)
        content = self._added_tokens.get(token_id)
        if content is not None and self._last_added:
            text = content
        self._last_added = content is not None
        return text

    def flush(self) -> str:
        return self._stream.flush()
